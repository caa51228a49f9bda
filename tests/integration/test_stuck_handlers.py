"""The watchdog's promise on a dead path (issue 23, item 4): a handler stopped because its lease
could not be extended is over before that lease can expire, also when it waits in a durable call
on a connection that answers nothing (`tests.support.blackhole`); a ``def`` handler that cannot
be interrupted is dealt with by ``on_stuck_handler``.

The bound asserted is the promise itself: the lease, counted from the call's start (its lease
was last extended before that); measured figures are in ``benchmarks/dead_path.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, SyncTaskContext, TaskContext, WorkerOptions
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.blackhole import black_hole_proxy
from tests.support.tasks import add
from tests.support.waiting import PATIENCE

LEASE = 4.0
#: One durable connection: the second call of a handler then runs its statement on the
#: connection its first call opened, so the stop meets a statement in flight (which psycopg
#: answers with a cancel request, into the hole too) and not a connection being opened (which
#: a cancellation ends at once): with several, the test passed on the code it was written for.
OPTIONS = WorkerOptions(
    lease_duration=LEASE, poll_interval=30.0, shutdown_grace=1.0, durable_connections=1
)


async def test_an_async_handler_stopped_in_a_durable_call_on_a_dead_path_ends_within_its_lease(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    go = asyncio.Event()
    marks: dict[str, float] = {}

    @registry.task("stepper")
    async def stepper(ctx: TaskContext, payload: None) -> None:
        await ctx.step("first", lambda: 1)
        marks["ready"] = time.monotonic()
        await go.wait()
        marks["call"] = time.monotonic()
        try:
            await ctx.step("second", lambda: 2)  # into the hole
        finally:
            marks["ended"] = time.monotonic()

    with black_hole_proxy(pgtask_database_url) as proxy:
        async with running_worker(registry, proxy.url(pgtask_database_url), OPTIONS):
            await add(pgtask_async_engine, "stepper")
            await wait_until(lambda: "ready" in marks, PATIENCE)
            proxy.black_hole()
            go.set()
            await wait_until(lambda: "ended" in marks, PATIENCE)
    took = marks["ended"] - marks["call"]
    assert took < LEASE, f"the handler ended {took:.2f} s after its call, past its lease"


async def test_a_def_handler_stopped_in_a_durable_call_on_a_dead_path_is_released_by_it(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    go = threading.Event()
    marks: dict[str, object] = {}

    @registry.task("stepper-sync")
    def stepper(ctx: SyncTaskContext, payload: None) -> None:
        ctx.step("first", lambda: 1)
        marks["ready"] = time.monotonic()
        go.wait(PATIENCE)
        marks["call"] = time.monotonic()
        try:
            ctx.step("second", lambda: 2)  # into the hole
        except BaseException as exc:
            marks["raised"] = type(exc).__name__
            raise
        finally:
            marks["ended"] = time.monotonic()

    with black_hole_proxy(pgtask_database_url) as proxy:
        async with running_worker(registry, proxy.url(pgtask_database_url), OPTIONS):
            await add(pgtask_async_engine, "stepper-sync")
            await wait_until(lambda: "ready" in marks, PATIENCE)
            proxy.black_hole()
            go.set()
            await wait_until(lambda: "ended" in marks, PATIENCE)
    assert marks["raised"] == "LeaseLost"
    took = float(marks["ended"]) - float(marks["call"])  # type: ignore[arg-type]
    assert took < LEASE, f"the handler was released {took:.2f} s after its call"


async def test_a_def_handler_stuck_in_user_code_past_its_lease_is_reported(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()
    release = threading.Event()
    started = threading.Event()

    @registry.task("stuck-sync")
    def stuck(ctx: SyncTaskContext, payload: None) -> None:
        started.set()
        release.wait(PATIENCE)  # ignores its stop request

    options = WorkerOptions(lease_duration=1.5, poll_interval=30.0, shutdown_grace=1.0)
    caplog.set_level(logging.WARNING, "sqlalchemy_pgtask.worker")
    try:
        with black_hole_proxy(pgtask_database_url) as proxy:
            async with running_worker(registry, proxy.url(pgtask_database_url), options):
                await add(pgtask_async_engine, "stuck-sync")
                await wait_until(started.is_set, PATIENCE)
                proxy.black_hole()  # renewals stop: the watchdog stops it, it runs on
                await wait_until(
                    lambda: any("(--on-stuck-handler warn)" in r.message for r in caplog.records),
                    PATIENCE, message="the stuck handler reported",
                )
    finally:
        release.set()


def test_on_stuck_handler_takes_warn_or_exit() -> None:
    assert WorkerOptions().on_stuck_handler == "warn"
    assert WorkerOptions(on_stuck_handler="exit").on_stuck_handler == "exit"
    with pytest.raises(InvalidOptionError, match="on_stuck_handler"):
        WorkerOptions(on_stuck_handler="kill")  # type: ignore[arg-type]
