"""What a real worker sends and logs, and the database clock it obeys.

* Every statement the worker executes binds exactly the parameters its statement declares
  (captured from the engine while a real worker claims, completes, fails, renews, releases
  and recovers).
* One claim statement serves all of a worker's queues, earlier queues first.
* A task enqueued without ``max_attempts`` gets its registered handler's.
* Each task's start and end are logged at INFO with structured fields.
* Retry delays and lease expiry follow the database clock: moving it is enough.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from sqlalchemy_pgtask import (
    Registry,
    Retry,
    RetryPolicy,
    TaskContext,
    WorkerOptions,
    enqueue_async,
    statements,
)
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state

STATEMENTS = {
    name: getattr(statements, name)
    for name in statements.__all__
    if isinstance(getattr(statements, name), ClauseElement)
}


@pytest.fixture
async def captured(pgtask_database_url: str) -> AsyncIterator[tuple[AsyncEngine, list[Any]]]:
    """An engine that records every (statement, parameters) executed through it."""
    engine = create_async_engine(pgtask_database_url)
    executed: list[tuple[ClauseElement, dict[str, Any]]] = []

    def record(_conn: Any, element: Any, multiparams: Any, params: Any, _opts: Any) -> None:
        bound: dict[str, Any] = dict(params or {})
        for item in multiparams or ():
            if isinstance(item, dict):
                bound.update(item)
        executed.append((element, bound))

    event.listen(engine.sync_engine, "before_execute", record)
    try:
        yield engine, executed
    finally:
        await engine.dispose()


def binds(statement: ClauseElement) -> tuple[set[str], set[str]]:
    """(required, all) bind names of ``statement`` as the worker's dialect compiles it."""
    compiled = statement.compile(dialect=_dialect())
    assert isinstance(compiled, SQLCompiler)
    return (
        {key for key, bind in compiled.binds.items() if bind.required},
        set(compiled.binds),
    )


def _dialect() -> Any:
    from sqlalchemy.dialects.postgresql import psycopg

    return psycopg.dialect()  # type: ignore[no-untyped-call]


async def test_every_statement_the_worker_executes_binds_exactly_what_it_declares(
    captured: tuple[AsyncEngine, list[Any]], pgtask_async_engine: AsyncEngine
) -> None:
    engine, executed = captured
    registry = Registry()
    release = asyncio.Event()

    @registry.task("ok")
    async def ok(ctx: TaskContext, payload: None) -> str:
        return "done"

    @registry.task("again", retry=RetryPolicy.fixed(0.0, jitter=False), max_attempts=2)
    async def again(ctx: TaskContext, payload: None) -> None:
        raise ValueError("fails both times")

    @registry.task("long")
    async def long(ctx: TaskContext, payload: None) -> None:
        await release.wait()

    ids = [await add(pgtask_async_engine, name) for name in ("ok", "again", "long")]
    options = WorkerOptions(lease_duration=0.6, shutdown_grace=0.0, poll_interval=30.0)
    async with running_worker(registry, engine, options) as worker:
        await wait_for_state(pgtask_async_engine, ids[0])
        await wait_for_state(pgtask_async_engine, ids[1])

        def renewed() -> bool:  # the long handler outlived a few renewals
            return sum(e[0] is statements.RENEW for e in executed) >= 2

        await wait_until(renewed, message="lease renewals")
        assert worker.running_count == 1
    # Shut down with the long handler running: its task was released.
    assert (await task_row(pgtask_async_engine, ids[2]))["state"] == "pending"

    seen: dict[str, int] = {}
    for element, params in executed:
        name = next((n for n, s in STATEMENTS.items() if s is element), None)
        if name is None:
            continue
        seen[name] = seen.get(name, 0) + 1
        required, allowed = binds(element)
        assert required <= set(params) <= allowed, (name, sorted(params))
    assert {
        "CLAIM", "SECONDS_UNTIL_DUE", "COMPLETE", "FAIL", "RENEW", "RELEASE", "RECOVER",
        "REGISTER_WORKER", "REGISTER_POLICIES", "STORED_POLICIES", "HEARTBEAT",
        "PRUNE_WORKERS", "RETIRE_WORKER",
    } <= set(seen)


async def test_one_claim_statement_serves_every_queue_earlier_queues_first(
    captured: tuple[AsyncEngine, list[Any]], pgtask_async_engine: AsyncEngine
) -> None:
    engine, executed = captured
    registry = Registry()
    started: list[str] = []
    queues = ("high", "mid", "low")
    for queue in queues:

        @registry.task("step", queue=queue)
        async def step(ctx: TaskContext, payload: None) -> None:
            started.append(ctx.queue)

    for queue in reversed(queues):  # the oldest task is in the last queue
        await add(pgtask_async_engine, "step", queue=queue)
    options = WorkerOptions(queues=queues, concurrency=1, lease_duration=5.0)
    async with running_worker(registry, engine, options):
        await wait_until(lambda: len(started) == 3, message="all three tasks to run")

    claims = [params for element, params in executed if element is statements.CLAIM]
    assert claims, "no claim was executed"
    assert all(params["queues"] == list(queues) for params in claims)
    assert started == list(queues)


async def test_a_task_enqueued_without_max_attempts_gets_its_handlers(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("flaky", retry=RetryPolicy.fixed(0.0, jitter=False), max_attempts=2)
    async def flaky(ctx: TaskContext, payload: None) -> None:
        raise ValueError("always")

    async with pgtask_async_engine.begin() as conn:
        task_id = (await enqueue_async(conn, "flaky")).id  # a plain enqueue, by name
    async with running_worker(registry, pgtask_database_url, WorkerOptions(lease_duration=5.0)):
        row = await wait_for_state(pgtask_async_engine, task_id)
    assert (row["state"], row["max_attempts"], row["failed_attempts"]) == ("failed", 2, 2)


async def test_each_task_is_logged_when_it_starts_and_ends_with_its_fields(
    pgtask_database_url: str,
    pgtask_async_engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sqlalchemy_pgtask.worker")
    registry = Registry()

    @registry.task("fine")
    async def fine(ctx: TaskContext, payload: None) -> None:
        return None

    @registry.task("broken", retry=RetryPolicy.never())
    async def broken(ctx: TaskContext, payload: None) -> None:
        raise KeyError("order 42")

    good, bad = await add(pgtask_async_engine, "fine"), await add(pgtask_async_engine, "broken")
    async with running_worker(registry, pgtask_database_url, WorkerOptions(lease_duration=5.0)):
        await wait_for_state(pgtask_async_engine, good)
        await wait_for_state(pgtask_async_engine, bad)

    def records(task_id: uuid.UUID) -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "task_id", None) == str(task_id)]

    start, end = records(good)
    assert (start.levelno, end.levelno) == (logging.INFO, logging.INFO)
    assert "started" in start.getMessage()
    assert (end.__dict__["outcome"], end.__dict__["task_name"]) == ("succeeded", "fine")
    assert end.__dict__["duration_seconds"] >= 0
    [_, failure] = records(bad)
    assert failure.levelno == logging.WARNING
    assert (failure.__dict__["outcome"], failure.__dict__["error_kind"]) == (
        "failed", "handler_error",
    )
    assert "KeyError: 'order 42'" in failure.getMessage()
    messages = [r.getMessage() for r in caplog.records]
    assert any("stopping; no new claims" in m for m in messages)
    assert any(m.endswith(": stopped") for m in messages)


# -- the database clock ----------------------------------------------------------------------


async def test_a_retry_an_hour_later_runs_once_the_database_clock_moves_an_hour(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("later")
    async def later(ctx: TaskContext, payload: None) -> int:
        if ctx.attempt == 1:
            raise Retry("not yet", delay=3600)
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "later")
    async with running_worker(registry, pgtask_database_url, WorkerOptions(lease_duration=5.0)):
        await wait_until(
            lambda: _retried(pgtask_async_engine, task_id), message="the first attempt to fail"
        )
        waiting = await task_row(pgtask_async_engine, task_id)
        pgtask_clock.advance(3600)
        row = await wait_for_state(pgtask_async_engine, task_id)
    assert waiting["state"] == "pending"
    assert (row["state"], row["result"], row["attempt"]) == ("succeeded", 2, 2)


async def _retried(engine: AsyncEngine, task_id: uuid.UUID) -> bool:
    return [a["state"] for a in await attempt_rows(engine, task_id)] == ["failed"]


async def test_an_expired_lease_is_recovered_once_the_database_clock_passes_it(
    pgtask_database_url: str,
    pgtask_async_engine: AsyncEngine,
    pgtask_engine: Engine,
    pgtask_clock: DatabaseClock,
) -> None:
    registry = Registry()

    @registry.task("orphan")
    async def orphan(ctx: TaskContext, payload: None) -> int:
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "orphan", max_attempts=3)
    with pgtask_engine.begin() as conn:  # a worker that died with an hour-long lease
        [claimed] = conn.execute(
            statements.CLAIM,
            statements.claim_params(
                statements.capability_params(
                    ["default"],
                    [statements.Capability("default", "orphan", 1, RetryPolicy.never(), 3)],
                ),
                worker_id=uuid.uuid4(), lease_seconds=3600.0, limit=1,
            ),
        ).all()
    async with running_worker(registry, pgtask_database_url, WorkerOptions(lease_duration=5.0)):
        assert (await task_row(pgtask_async_engine, task_id))["state"] == "running"
        pgtask_clock.advance(3601)
        row = await wait_for_state(pgtask_async_engine, task_id)
    assert claimed.id == task_id
    assert (row["state"], row["result"], row["failed_attempts"]) == ("succeeded", 2, 1)
