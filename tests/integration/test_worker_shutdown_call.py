"""`Worker.shutdown()` is one call for every caller: plain code (a signal handler, another
thread) calls it, async code may also await it, and awaiting waits until the worker stopped.

Each test runs a real worker against PostgreSQL.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, TaskContext, Worker, WorkerOptions
from tests.support.tasks import add, wait_for_state
from tests.support.waiting import PATIENCE

FAST = WorkerOptions(lease_duration=3.0, poll_interval=30.0, shutdown_grace=5.0)


def _registry(started: asyncio.Event, finish: asyncio.Event) -> Registry:
    registry = Registry()

    @registry.task("work")
    async def work(ctx: TaskContext, payload: None) -> str:
        started.set()
        await finish.wait()
        return "done"

    return registry


async def test_awaiting_shutdown_returns_once_the_worker_has_stopped(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    started, finish = asyncio.Event(), asyncio.Event()
    worker = Worker(_registry(started, finish), pgtask_database_url, FAST)
    runner = asyncio.create_task(worker.run())
    task_id = await add(pgtask_async_engine, "work")
    await asyncio.wait_for(started.wait(), PATIENCE)

    stopping = asyncio.create_task(asyncio.wait_for(worker.shutdown(), PATIENCE))
    await asyncio.sleep(0)  # let the request reach the worker; the handler still runs
    assert not stopping.done()
    finish.set()
    await stopping
    # Awaited, it returns only after run() did: the drained handler's outcome is written.
    assert runner.done()
    await runner
    assert (await wait_for_state(pgtask_async_engine, task_id))["state"] == "succeeded"


async def test_shutdown_is_still_a_plain_call_from_another_thread(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    started, finish = asyncio.Event(), asyncio.Event()
    finish.set()
    worker = Worker(_registry(started, finish), pgtask_database_url, FAST)
    runner = asyncio.create_task(worker.run())
    await worker.wait_until_ready(PATIENCE)
    caller = threading.Thread(target=worker.shutdown)
    caller.start()
    caller.join(PATIENCE)
    await asyncio.wait_for(runner, PATIENCE)
    # Awaiting a shutdown of a worker that stopped already returns at once.
    await asyncio.wait_for(worker.shutdown(), PATIENCE)


async def test_awaiting_shutdown_of_a_worker_that_never_ran_returns_at_once(
    pgtask_database_url: str,
) -> None:
    started, finish = asyncio.Event(), asyncio.Event()
    worker = Worker(_registry(started, finish), pgtask_database_url, FAST)
    await asyncio.wait_for(worker.shutdown(), PATIENCE)
    # The request stands: run() returns right after its startup.
    await asyncio.wait_for(worker.run(), PATIENCE)


def test_a_worker_cancelled_with_its_event_loop_does_not_report_its_loops_as_failed(
    pgtask_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # asyncio.run() ending on an error cancels every task left, the worker's own loops and
    # run() together: that is the process stopping, not a loop failing.
    started, finish = asyncio.Event(), asyncio.Event()

    async def main() -> None:
        worker = Worker(_registry(started, finish), pgtask_database_url, FAST)
        asyncio.create_task(worker.run())  # noqa: RUF006 - asyncio.run cancels it
        await worker.wait_until_ready(PATIENCE)
        raise LookupError("the application failed")

    caplog.set_level(logging.INFO, logger="sqlalchemy_pgtask.worker")
    with pytest.raises(LookupError):
        asyncio.run(main())
    failures = [r.getMessage() for r in caplog.records if "loop failed" in r.getMessage()]
    assert failures == []
