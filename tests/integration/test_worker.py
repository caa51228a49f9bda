"""The in-process worker end to end: handlers, failures, leases, registration and shutdown.

Every test runs a real `Worker` (``running_worker``) against its own database, with short
leases so lease behaviour shows within a second or two. Tests synchronise on events set by
handlers and on database state polled with a deadline that only bounds a hang, never on a
bare sleep. Retry delays, delayed tasks and lease expiry are reached by moving the database
clock (``pgtask_clock``), not by waiting; the worker those tests run polls every 600 s, so a
task that runs within the deadline was woken by a notification (the clock's move sends one)
or by the database's next ``run_at``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, delete, event, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    Attempt,
    Fail,
    HandlerPolicy,
    LeaseLost,
    PolicyConflict,
    Registry,
    Retry,
    RetryPolicy,
    SyncTaskContext,
    Task,
    TaskContext,
    Worker,
    WorkerCapability,
    WorkerOptions,
    WorkerRecord,
    statements,
)
from sqlalchemy_pgtask._driver_sql import driver_statement
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.engines import executions_of
from tests.support.tasks import (
    add,
    attempt_rows,
    claim_parameters,
    task_row,
    wait_for_state,
)
from tests.support.waiting import PATIENCE, SLOW_POLL, wait_event

LEASE = 1.5
FAST = WorkerOptions(
    lease_duration=LEASE, heartbeat_interval=0.5, worker_ttl=2.0, shutdown_grace=2.0
)
NO_JITTER = RetryPolicy.fixed(0.0, jitter=False)
#: Only a notification, a moved database clock or a due ``run_at`` wakes this worker within
#: PATIENCE.
SLOW = WorkerOptions(
    lease_duration=LEASE, heartbeat_interval=0.5, worker_ttl=2.0, shutdown_grace=2.0,
    poll_interval=SLOW_POLL,
)


# -- helpers -------------------------------------------------------------------------------


async def db_now(engine: AsyncEngine) -> Any:
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT statement_timestamp()"))).scalar_one()


async def advance_to_retry(
    engine: AsyncEngine,
    clock: DatabaseClock,
    task_id: uuid.UUID,
    failed_attempts: int,
    delay: float,
) -> None:
    """Wait until the task's ``failed_attempts``-th failure is written; check that its retry
    falls due exactly ``delay`` seconds of database time after that attempt ended; then move
    the database clock that far (which also wakes idle workers)."""
    row: dict[str, Any] = {}

    async def written() -> bool:
        nonlocal row
        row = await task_row(engine, task_id)
        return bool(row["state"] == "pending" and row["failed_attempts"] == failed_attempts)

    await wait_until(written, PATIENCE, message=f"failure {failed_attempts} of {task_id}")
    finished = (await attempt_rows(engine, task_id))[-1]["finished_at"]
    assert row["run_at"] == finished + timedelta(seconds=delay)
    clock.advance(delay)


# -- handlers succeed ----------------------------------------------------------------------


async def test_async_and_sync_handlers_succeed_and_store_their_results(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    registry = Registry()
    seen: dict[str, Any] = {}

    @registry.task("double")
    async def double(ctx: TaskContext, payload: dict[str, int]) -> dict[str, int]:
        seen["async"] = ctx
        return {"double": payload["n"] * 2}

    @registry.task("shout", queue="sync-queue")
    def shout(ctx: SyncTaskContext, payload: str) -> list[str]:
        seen["sync"] = ctx
        # The claim committed before this handler started: another connection sees it.
        with pgtask_engine.connect() as conn:
            row = conn.execute(
                select(Task.state, Task.attempt, Task.lease_owner).where(Task.id == ctx.task_id)
            ).one()
            attempt_state = conn.execute(
                select(Attempt.state).where(
                    Attempt.task_id == ctx.task_id, Attempt.attempt == ctx.attempt
                )
            ).scalar_one()
        seen["visible"] = (tuple(row), attempt_state)
        return [payload.upper(), threading.current_thread().name]

    async_id = await add(pgtask_async_engine, "double", {"n": 21}, headers={"trace": "t-1"})
    sync_id = await add(pgtask_async_engine, "shout", "hi", queue="sync-queue")
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        first = await wait_for_state(pgtask_async_engine, async_id)
        second = await wait_for_state(pgtask_async_engine, sync_id)

    assert (first["state"], first["result"], first["error"]) == ("succeeded", {"double": 42}, None)
    assert second["state"] == "succeeded"
    assert second["result"][0] == "HI"
    assert second["result"][1].startswith("pgtask-handler-")  # ran in a handler thread
    for row in (first, second):
        assert (row["attempt"], row["failed_attempts"]) == (1, 0)
        assert row["lease_token"] is None
    ctx = seen["async"]
    assert (ctx.task_id, ctx.name, ctx.queue, ctx.attempt) == (async_id, "double", "default", 1)
    assert ctx.headers == {"trace": "t-1"}
    assert seen["sync"].headers == {}  # none given
    assert ctx.worker_id == worker.id
    assert seen["visible"] == (("running", 1, worker.id), "running")
    for task_id in (async_id, sync_id):
        [attempt] = await attempt_rows(pgtask_async_engine, task_id)
        assert (attempt["state"], attempt["worker_id"], attempt["error"]) == (
            "succeeded", worker.id, None,
        )


# -- handler failures ----------------------------------------------------------------------


async def test_the_log_says_no_attempts_are_left_when_the_last_one_fails(
    pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()

    @registry.task("once", retry=RetryPolicy.fixed(0.4, jitter=False), max_attempts=1)
    async def once(ctx: TaskContext, payload: None) -> None:
        raise ValueError("broken")

    task_id = await add(pgtask_async_engine, "once")
    with caplog.at_level(logging.WARNING, logger="sqlalchemy_pgtask.worker"):
        async with running_worker(registry, pgtask_async_engine, SLOW):
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "failed"
    [record] = [r for r in caplog.records if str(task_id) in r.getMessage()]
    assert record.getMessage().endswith("; no attempts left")
    assert getattr(record, "outcome", None) == "failed"


async def test_an_exception_is_a_structured_error_retried_by_policy_until_attempts_run_out(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()
    policy = RetryPolicy.exponential(base=3600.0, factor=2.0, max=5400.0, jitter=False)

    @registry.task("flaky", retry=policy, max_attempts=3)
    async def flaky(ctx: TaskContext, payload: None) -> None:
        raise ValueError(f"attempt {ctx.attempt} broke")

    task_id = await add(pgtask_async_engine, "flaky", max_attempts=3)
    # Each retry waits the stored policy's delay in database time: an hour, then two hours
    # capped to an hour and a half. It runs once the database clock has moved that far (which
    # wakes idle workers), long before the poll interval.
    async with running_worker(registry, pgtask_database_url, SLOW):
        for failed, delay in enumerate((3600.0, 5400.0), start=1):
            await advance_to_retry(pgtask_async_engine, pgtask_clock, task_id, failed, delay)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)

    assert row["state"] == "failed"
    assert (row["attempt"], row["failed_attempts"]) == (3, 3)
    assert row["completed_at"] is not None
    assert row["result"] is None
    error = row["error"]
    assert error["type"] == "handler_error"
    assert error["exception"] == "ValueError"
    assert error["message"] == "attempt 3 broke"
    assert error["traceback"].startswith("Traceback (most recent call last):")
    assert "ValueError: attempt 3 broke" in error["traceback"]
    assert "in flaky" in error["traceback"]

    attempts = await attempt_rows(pgtask_async_engine, task_id)
    assert [a["state"] for a in attempts] == ["failed", "failed", "failed"]
    assert [a["error"]["message"] for a in attempts] == [
        f"attempt {n} broke" for n in (1, 2, 3)
    ]
    # Never early by the database's clock.
    for index, delay in enumerate((3600.0, 5400.0)):
        gap = attempts[index + 1]["started_at"] - attempts[index]["finished_at"]
        assert gap >= timedelta(seconds=delay)


async def test_retries_follow_the_policy_stored_on_the_task_not_the_registry(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("snapshotted", retry=RetryPolicy.fixed(3600.0))
    async def snapshotted(ctx: TaskContext, payload: None) -> int:
        if ctx.attempt == 1:
            raise ConnectionError("first attempt fails")
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "snapshotted")
    # As if an earlier claim had snapshotted another policy onto this task.
    async with pgtask_async_engine.begin() as conn:
        await conn.execute(
            update(Task).where(Task.id == task_id).values(
                retry_kind="fixed", retry_base_seconds=120.0, retry_jitter=False
            )
        )
    async with running_worker(registry, pgtask_database_url, SLOW):
        # Two minutes (the task's policy), not the registry's hour.
        await advance_to_retry(pgtask_async_engine, pgtask_clock, task_id, 1, 120)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"], row["failed_attempts"]) == ("succeeded", 2, 1)
    first, second = await attempt_rows(pgtask_async_engine, task_id)
    assert second["started_at"] - first["finished_at"] >= timedelta(seconds=120)
    assert row["retry_base_seconds"] == 120.0


async def test_fail_and_non_retryable_exceptions_fail_at_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    class BadInput(Exception):
        pass

    @registry.task("gives-up", retry=NO_JITTER, max_attempts=5)
    async def gives_up(ctx: TaskContext, payload: None) -> None:
        raise Fail("the order was deleted")

    @registry.task("strict", retry=NO_JITTER, max_attempts=5, non_retryable=(BadInput,))
    def strict(ctx: SyncTaskContext, payload: None) -> None:
        raise BadInput("malformed payload")

    fail_id = await add(pgtask_async_engine, "gives-up", max_attempts=5)
    strict_id = await add(pgtask_async_engine, "strict", max_attempts=5)
    async with running_worker(registry, pgtask_database_url, FAST):
        failed = await wait_for_state(pgtask_async_engine, fail_id)
        rejected = await wait_for_state(pgtask_async_engine, strict_id)

    for row in (failed, rejected):
        assert row["state"] == "failed"
        assert (row["attempt"], row["failed_attempts"]) == (1, 1)
    assert failed["error"]["type"] == "fail"
    assert rejected["error"]["type"] == "non_retryable"
    assert failed["error"]["exception"] == "sqlalchemy_pgtask.control.Fail"
    assert failed["error"]["message"] == "the order was deleted"
    assert rejected["error"]["exception"].endswith("BadInput")
    assert rejected["error"]["message"] == "malformed payload"
    for task_id in (fail_id, strict_id):
        assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
            "failed"
        ]


async def test_retry_with_a_delay_runs_again_after_that_delay(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("later", retry=RetryPolicy.fixed(3600.0))
    async def later(ctx: TaskContext, payload: None) -> str:
        if ctx.attempt == 1:
            raise Retry("not yet", delay=1800)
        return "done"

    task_id = await add(pgtask_async_engine, "later")
    async with running_worker(registry, pgtask_database_url, SLOW):
        # The Retry's half hour, not the policy's hour.
        await advance_to_retry(pgtask_async_engine, pgtask_clock, task_id, 1, 1800)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", "done")
    assert (row["attempt"], row["failed_attempts"]) == (2, 1)  # a retry counts as a failure
    first, second = await attempt_rows(pgtask_async_engine, task_id)
    assert (first["state"], first["error"]["type"]) == ("failed", "retry")
    assert first["error"]["message"] == "not yet"
    assert second["started_at"] - first["finished_at"] >= timedelta(seconds=1800)


async def test_retry_without_attempts_left_fails(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("again")
    async def again(ctx: TaskContext, payload: None) -> None:
        raise Retry(delay=0.0)

    task_id = await add(pgtask_async_engine, "again", max_attempts=2)
    async with running_worker(registry, pgtask_database_url, FAST):
        row = await wait_for_state(pgtask_async_engine, task_id)
    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("failed", 2, 2)


async def test_int_and_float_retry_delays_are_written_in_one_batch(
    pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()
    go = asyncio.Event()

    @registry.task("retry-later")
    async def retry_later(ctx: TaskContext, payload: float) -> None:
        await asyncio.wait_for(go.wait(), 10)
        raise Retry(delay=payload)  # an int is a valid number of seconds

    whole, half = [await add(pgtask_async_engine, "retry-later", d) for d in (1, 0.5)]
    fails: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "request.delay" in statement:
            fails.append(statement)

    event.listen(pgtask_async_engine.sync_engine, "before_cursor_execute", count)
    with caplog.at_level(logging.ERROR, logger="sqlalchemy_pgtask.worker"):
        async with running_worker(registry, pgtask_async_engine, FAST):
            await wait_for_state(pgtask_async_engine, whole, ("running",))
            await wait_for_state(pgtask_async_engine, half, ("running",))
            go.set()  # both fail in the same loop iteration: one write batch
            rows = [
                await wait_for_state(pgtask_async_engine, i, ("pending",)) for i in (whole, half)
            ]
    for row, delay in zip(rows, (1, 0.5), strict=True):
        assert row["run_at"] - row["updated_at"] == timedelta(seconds=delay)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert len(fails) == 1


async def test_a_registry_mixing_int_and_float_retry_seconds_starts_and_runs(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("whole-seconds", retry=RetryPolicy("fixed", base_seconds=1))
    async def whole_seconds(ctx: TaskContext, payload: None) -> str:
        return "ran"

    @registry.task("fractional", retry=RetryPolicy.fixed(0.5))
    async def fractional(ctx: TaskContext, payload: None) -> str:
        return "ran"

    ids = [await add(pgtask_async_engine, name) for name in ("whole-seconds", "fractional")]
    async with running_worker(registry, pgtask_database_url, FAST):
        rows = [await wait_for_state(pgtask_async_engine, i) for i in ids]
    assert [row["state"] for row in rows] == ["succeeded", "succeeded"]


@pytest.mark.parametrize(
    "value",
    [pytest.param("x" * (1024 * 1024 + 1), id="over-1-mib"), pytest.param({1, 2}, id="a-set"),
     pytest.param(float("nan"), id="nan"), pytest.param("nul\x00", id="nul")],
)
async def test_an_unstorable_result_is_a_terminal_result_rejected_failure(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, value: object
) -> None:
    registry = Registry()
    calls = []

    @registry.task("bad-result", retry=NO_JITTER)
    async def bad_result(ctx: TaskContext, payload: None) -> object:
        calls.append(ctx.attempt)
        return value

    task_id = await add(pgtask_async_engine, "bad-result", max_attempts=5)
    async with running_worker(registry, pgtask_database_url, FAST):
        row = await wait_for_state(pgtask_async_engine, task_id)
    # Retrying would return the same value forever: it fails at once.
    assert calls == [1]
    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("failed", 1, 1)
    assert row["result"] is None
    assert row["error"]["type"] == "result_rejected"
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    assert (attempt["state"], attempt["error"]["type"]) == ("failed", "result_rejected")


async def test_an_error_message_with_nul_and_lone_surrogates_is_stored(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("binary", retry=RetryPolicy.never())
    def binary(ctx: SyncTaskContext, payload: None) -> None:
        raise ValueError("nul\x00 and half a pair \udc80 and " + "\x00" * 2_000_000)

    task_id = await add(pgtask_async_engine, "binary")
    async with running_worker(registry, pgtask_database_url, FAST):
        row = await wait_for_state(pgtask_async_engine, task_id)
    assert row["state"] == "failed"
    assert row["error"]["exception"] == "ValueError"
    assert row["error"]["message"].startswith("nul")
    assert row["error"]["message_truncated"] is True
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    assert attempt["error"] == row["error"]


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise TypeError("not all arguments converted during string formatting")


async def test_an_exception_that_cannot_be_printed_still_fails_the_attempt(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("unprintable", retry=RetryPolicy.never())
    async def unprintable(ctx: TaskContext, payload: None) -> None:
        raise UnprintableError()

    task_id = await add(pgtask_async_engine, "unprintable")
    # A worker that fails to settle the attempt would renew its lease forever: give it a
    # deadline, not forever.
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        await wait_until(lambda: worker.active_count == 0, PATIENCE, message="the slot is freed")
    assert (row["state"], row["failed_attempts"]) == ("failed", 1)
    assert row["error"]["type"] == "handler_error"
    assert row["error"]["exception"].endswith("UnprintableError")
    assert "traceback" in row["error"]


async def test_a_too_deeply_nested_result_is_a_terminal_result_rejected_failure(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("deep")
    async def deep(ctx: TaskContext, payload: None) -> object:
        value: list[Any] = []
        for _ in range(100_000):
            value = [value]
        return value

    task_id = await add(pgtask_async_engine, "deep")
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        await wait_until(lambda: worker.active_count == 0, PATIENCE, message="the slot is freed")
    assert (row["state"], row["failed_attempts"]) == ("failed", 1)
    assert row["error"]["type"] == "result_rejected"


# -- isolation and concurrency -------------------------------------------------------------


async def test_a_crashing_handler_does_not_disturb_handlers_running_beside_it(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    async_started, async_release = asyncio.Event(), asyncio.Event()
    sync_started, sync_release = threading.Event(), threading.Event()
    disturbed: list[str] = []

    @registry.task("steady-async")
    async def steady_async(ctx: TaskContext, payload: None) -> str:
        async_started.set()
        try:
            await async_release.wait()
        except BaseException as exc:
            disturbed.append(f"async: {exc!r}")
            raise
        return "async survived"

    @registry.task("steady-sync")
    def steady_sync(ctx: SyncTaskContext, payload: None) -> str:
        sync_started.set()
        if not sync_release.wait(timeout=20) or ctx.cancelled:
            disturbed.append(f"sync: {ctx.stop_reason}")
        return "sync survived"

    @registry.task("exits", retry=RetryPolicy.never())
    async def exits(ctx: TaskContext, payload: None) -> None:
        raise SystemExit(3)

    @registry.task("exits-in-thread", retry=RetryPolicy.never())
    def exits_in_thread(ctx: SyncTaskContext, payload: None) -> None:
        raise SystemExit(4)

    @registry.task("raises-in-thread", retry=RetryPolicy.never())
    def raises_in_thread(ctx: SyncTaskContext, payload: None) -> None:
        raise RuntimeError("sync handler blew up")

    options = WorkerOptions(lease_duration=LEASE, concurrency=8, shutdown_grace=5.0)
    steady = [await add(pgtask_async_engine, name) for name in ("steady-async", "steady-sync")]
    try:
        async with running_worker(registry, pgtask_database_url, options) as worker:
            await wait_event(async_started)
            await wait_event(sync_started)
            crashing = [
                await add(pgtask_async_engine, name)
                for name in ("exits", "exits-in-thread", "raises-in-thread")
            ]
            crashed = [await wait_for_state(pgtask_async_engine, i) for i in crashing]
            # Both steady handlers are still running, untouched, while the others crashed.
            for task_id in steady:
                assert (await task_row(pgtask_async_engine, task_id))["state"] == "running"
            await wait_until(
                lambda: worker.active_count == 2, PATIENCE, message="crashed slots freed"
            )
            async_release.set()
            sync_release.set()
            survived = [await wait_for_state(pgtask_async_engine, i) for i in steady]
            # The worker still claims and runs new work afterwards.
            follow_up = await add(pgtask_async_engine, "steady-async")
            assert (await wait_for_state(pgtask_async_engine, follow_up))["state"] == "succeeded"
    finally:
        sync_release.set()
    assert disturbed == []
    assert [row["state"] for row in survived] == ["succeeded", "succeeded"]
    assert [row["result"] for row in survived] == ["async survived", "sync survived"]
    assert [row["state"] for row in crashed] == ["failed"] * 3
    assert [row["error"]["exception"] for row in crashed] == [
        "SystemExit", "SystemExit", "RuntimeError",
    ]
    assert all(row["error"]["type"] == "handler_error" for row in crashed)


@pytest.mark.parametrize("prefetch", [0, 2])  # the bound must be reachable by 10 tasks
async def test_claims_never_exceed_the_concurrency(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, prefetch: int
) -> None:
    registry = Registry()
    concurrency = 3
    lock = threading.Lock()
    running = 0
    peak = 0
    full = asyncio.Event()

    @registry.task("counted")
    async def counted(ctx: TaskContext, payload: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            if running == concurrency:
                full.set()
        try:
            # Hold the slot until all slots were busy at once, so the overlap is real.
            await asyncio.wait_for(full.wait(), 10)
            await asyncio.sleep(0)
        finally:
            with lock:
                running -= 1
        return payload

    ids = [await add(pgtask_async_engine, "counted", n) for n in range(10)]
    options = WorkerOptions(lease_duration=LEASE, concurrency=concurrency, prefetch=prefetch)
    async with running_worker(registry, pgtask_database_url, options) as worker:
        active_peak = 0

        async def all_done() -> bool:
            nonlocal active_peak
            active_peak = max(active_peak, worker.active_count)
            async with pgtask_async_engine.connect() as conn:
                states = (await conn.execute(select(Task.state))).scalars().all()
            return set(states) == {"succeeded"}

        await wait_until(all_done, 20, message="every task succeeded")
    assert peak == concurrency
    # Finished attempts may wait for the outcome writer without holding a handler slot, but
    # no more of them than the concurrency plus the prefetch: started-and-unrecorded stays
    # within that plus the slots.
    assert active_peak <= 2 * concurrency + prefetch
    results = [(await task_row(pgtask_async_engine, i))["result"] for i in ids]
    assert results == list(range(10))


async def test_tasks_without_a_registered_handler_stay_pending_while_known_ones_finish(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("known")
    async def known(ctx: TaskContext, payload: None) -> str:
        return "ran"

    # Enqueued first, so a worker that could claim them would have taken them first.
    unknown = [
        await add(pgtask_async_engine, "unknown"),
        await add(pgtask_async_engine, "known", version=2),
        await add(pgtask_async_engine, "known", queue="not-served"),
    ]
    known_ids = [await add(pgtask_async_engine, "known") for _ in range(3)]
    async with running_worker(registry, pgtask_database_url, FAST):
        for task_id in known_ids:
            assert (await wait_for_state(pgtask_async_engine, task_id))["state"] == "succeeded"
    for task_id in unknown:
        row = await task_row(pgtask_async_engine, task_id)
        assert (row["state"], row["attempt"], row["lease_token"]) == ("pending", 0, None)
        assert await attempt_rows(pgtask_async_engine, task_id) == []


# -- leases --------------------------------------------------------------------------------


async def test_lease_renewal_keeps_a_long_handler_alive_past_three_lease_durations(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    started, finish = asyncio.Event(), asyncio.Event()
    lease = 0.9

    @registry.task("long")
    async def long(ctx: TaskContext, payload: None) -> int:
        started.set()
        await asyncio.wait_for(finish.wait(), 20)
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "long")
    options = WorkerOptions(lease_duration=lease, heartbeat_interval=0.3, worker_ttl=1.0)
    async with running_worker(registry, pgtask_database_url, options):
        await wait_event(started)
        claimed = await task_row(pgtask_async_engine, task_id)
        first_expiry = claimed["lease_expires_at"]
        # Database time plus the lease: at the claim, or later if a renewal came first.
        assert first_expiry >= claimed["updated_at"] + timedelta(seconds=lease)

        # Watch database time run past three lease durations while the handler works.
        async def three_leases_passed() -> bool:
            row = await task_row(pgtask_async_engine, task_id)
            now = await db_now(pgtask_async_engine)
            assert (row["state"], row["attempt"]) == ("running", 1), "the lease was lost"
            assert row["lease_expires_at"] > now - timedelta(seconds=0.1)
            return bool(now > claimed["updated_at"] + timedelta(seconds=3 * lease))

        await wait_until(three_leases_passed, 15, message="three lease durations")
        assert (await task_row(pgtask_async_engine, task_id))["lease_expires_at"] > first_expiry
        finish.set()
        row = await wait_for_state(pgtask_async_engine, task_id)
    assert (row["state"], row["result"], row["attempt"], row["failed_attempts"]) == (
        "succeeded", 1, 1, 0,
    )
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
        "succeeded"
    ]


async def test_a_task_whose_worker_died_is_recovered_after_its_lease_and_run_again(
    pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("orphan")
    async def orphan(ctx: TaskContext, payload: None) -> int:
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "orphan", max_attempts=3)
    # Another worker claimed it for an hour and died: nobody renews that lease.
    dead_worker = uuid.uuid4()
    async with pgtask_async_engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        [claimed] = (
            await conn.execute(
                statements.CLAIM,
                claim_parameters(
                    worker_id=dead_worker, lease=3600, identities=[("orphan", 1)],
                    policy=RetryPolicy.never(), max_attempts=3, limit=1,
                ),
            )
        ).all()
    assert claimed.id == task_id
    expires_at = (await task_row(pgtask_async_engine, task_id))["lease_expires_at"]
    recoveries = executions_of(pgtask_async_engine.sync_engine, statements.RECOVER)
    async with running_worker(registry, pgtask_async_engine, SLOW) as worker:
        # The live worker's recovery runs (every third of its lease) and leaves the lease alone
        # while it has not expired.
        await wait_until(lambda: len(recoveries) >= 2, PATIENCE, message="two recovery passes")
        assert (await task_row(pgtask_async_engine, task_id))["state"] == "running"
        pgtask_clock.advance(3600)  # now it has expired
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    # Recovery counted the lost attempt as failed and the live worker ran attempt 2, even
    # though the snapshotted policy is "never": a lost lease is not a handler failure.
    assert (row["state"], row["result"], row["attempt"], row["failed_attempts"]) == (
        "succeeded", 2, 2, 1,
    )
    attempts = await attempt_rows(pgtask_async_engine, task_id)
    assert [(a["state"], a["worker_id"]) for a in attempts] == [
        ("lost", dead_worker), ("succeeded", worker.id),
    ]
    assert attempts[0]["error"] == {"type": "lease_expired"}
    assert attempts[0]["finished_at"] >= expires_at  # never before the lease expired


async def steal_lease(engine: AsyncEngine, task_id: uuid.UUID) -> uuid.UUID:
    """Another worker takes the task over: a new token, and a lease that will not expire soon."""
    thief = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            update(Task)
            .where(Task.id == task_id)
            .values(
                lease_token=thief,
                lease_expires_at=text("statement_timestamp() + interval '1 hour'"),
            )
        )
    return thief


async def test_an_async_handler_whose_lease_was_taken_is_cancelled_and_writes_nothing(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    started, cancelled, finally_ran = asyncio.Event(), asyncio.Event(), asyncio.Event()

    @registry.task("victim")
    async def victim(ctx: TaskContext, payload: None) -> dict[str, bool]:
        started.set()
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 30)
        except asyncio.CancelledError:
            cancelled.set()
            return {"late": True}  # swallows the cancellation: a late result to discard
        finally:
            finally_ran.set()
        return {"timed out": True}

    task_id = await add(pgtask_async_engine, "victim")
    options = WorkerOptions(lease_duration=0.9)
    async with running_worker(registry, pgtask_database_url, options) as worker:
        await wait_event(started)
        thief = await steal_lease(pgtask_async_engine, task_id)
        before = await task_row(pgtask_async_engine, task_id)
        await wait_event(cancelled, PATIENCE)
        await wait_event(finally_ran, PATIENCE)
        await wait_until(lambda: worker.active_count == 0, PATIENCE, message="the slot is freed")
        after = await task_row(pgtask_async_engine, task_id)
    assert after == before
    assert (after["state"], after["lease_token"], after["result"]) == ("running", thief, None)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == ["running"]


async def test_a_sync_handler_whose_lease_was_taken_sees_it_and_its_result_is_discarded(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    started = threading.Event()
    observed: dict[str, Any] = {}

    @registry.task("sync-victim")
    def sync_victim(ctx: SyncTaskContext, payload: None) -> dict[str, bool]:
        started.set()
        deadline = time.monotonic() + 10
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler's own unit of work
        observed["cancelled"] = ctx.cancelled
        observed["reason"] = ctx.stop_reason
        try:
            ctx.check()
        except LeaseLost as exc:
            observed["check"] = exc
        return {"late": True}  # ignores the stop request: must not be recorded

    task_id = await add(pgtask_async_engine, "sync-victim")
    options = WorkerOptions(lease_duration=0.9)
    async with running_worker(registry, pgtask_database_url, options) as worker:
        await wait_event(started)
        thief = await steal_lease(pgtask_async_engine, task_id)
        before = await task_row(pgtask_async_engine, task_id)
        await wait_until(lambda: "reason" in observed, 10, message="the handler saw the stop")
        await wait_until(lambda: worker.active_count == 0, PATIENCE, message="the slot is freed")
        after = await task_row(pgtask_async_engine, task_id)
    assert observed["cancelled"] is True
    assert observed["reason"] == "lease_lost"
    assert isinstance(observed.get("check"), LeaseLost)
    assert after == before
    assert (after["state"], after["lease_token"], after["result"]) == ("running", thief, None)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == ["running"]


# -- registration --------------------------------------------------------------------------


async def test_a_worker_registers_its_capabilities_heartbeats_and_retires_on_shutdown(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    for name, version, queue in (("a", 1, "default"), ("a", 2, "default"), ("b", 1, "other")):
        registry.task(name, version=version, queue=queue)(lambda ctx, payload: None)
    # A TTL of twelve heartbeats: a loaded CI host once delayed one past a TTL of five (1 s).
    ttl = 2.5
    options = WorkerOptions(
        lease_duration=LEASE, heartbeat_interval=0.2, worker_ttl=ttl, concurrency=4
    )

    async def worker_row(worker_id: uuid.UUID) -> dict[str, Any]:
        async with pgtask_async_engine.connect() as conn:
            rows = await conn.execute(
                select(WorkerRecord.__table__).where(WorkerRecord.id == worker_id)
            )
            return dict(rows.mappings().one())

    async with running_worker(registry, pgtask_database_url, options) as worker:
        registered = await worker_row(worker.id)
        assert registered["queues"] == ["default", "other"]
        assert (registered["pid"], registered["hostname"]) == (os.getpid(), socket.gethostname())
        assert registered["concurrency"] == 4
        assert registered["draining"] is False
        async with pgtask_async_engine.connect() as conn:
            capabilities = (
                await conn.execute(
                    select(WorkerCapability.queue, WorkerCapability.name, WorkerCapability.version)
                    .where(WorkerCapability.worker_id == worker.id)
                )
            ).all()
            policies = (
                await conn.execute(select(HandlerPolicy.queue, HandlerPolicy.name,
                                          HandlerPolicy.version))
            ).all()
        identities = {("default", "a", 1), ("default", "a", 2), ("other", "b", 1)}
        assert set(map(tuple, capabilities)) == identities
        assert set(map(tuple, policies)) == identities

        # Live well past its TTL: the heartbeat keeps pushing expires_at ahead.
        async def past_the_ttl() -> bool:
            now = await db_now(pgtask_async_engine)
            row = await worker_row(worker.id)
            assert row["expires_at"] > now, "the worker looked dead while running"
            return bool(now > registered["started_at"] + timedelta(seconds=1.5 * ttl))

        await wait_until(past_the_ttl, 10, message="longer than the TTL")
        assert (await worker_row(worker.id))["heartbeat_at"] > registered["heartbeat_at"]

        # An operator (or a cleanup job) deleted the row: the next heartbeat registers again.
        async with pgtask_async_engine.begin() as conn:
            await conn.execute(delete(WorkerRecord).where(WorkerRecord.id == worker.id))

        async def registered_again() -> bool:
            async with pgtask_async_engine.connect() as conn:
                count = await conn.execute(
                    select(WorkerCapability.name).where(WorkerCapability.worker_id == worker.id)
                )
                return len(count.all()) == 3

        await wait_until(registered_again, PATIENCE, message="the worker registered again")

    retired = await worker_row(worker.id)
    assert retired["draining"] is True
    assert retired["expires_at"] <= await db_now(pgtask_async_engine)


async def test_registering_another_retry_policy_for_a_known_handler_is_a_conflict(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    first = Registry()
    first.task("charge", retry=RetryPolicy.fixed(5.0))(lambda ctx, payload: None)
    async with running_worker(first, pgtask_database_url, FAST):
        pass

    second = Registry()
    second.task("charge", retry=RetryPolicy.fixed(6.0))(lambda ctx, payload: None)
    with pytest.raises(PolicyConflict, match="new version"):
        async with running_worker(second, pgtask_database_url, FAST):
            pytest.fail("a worker with a conflicting policy must not start")

    async with pgtask_async_engine.connect() as conn:
        stored = (await conn.execute(select(HandlerPolicy.__table__))).mappings().all()
        live = (
            await conn.execute(
                select(WorkerRecord.id).where(
                    WorkerRecord.expires_at > text("statement_timestamp()")
                )
            )
        ).all()
    assert [(p["name"], p["retry_kind"], p["retry_base_seconds"]) for p in stored] == [
        ("charge", "fixed", 5.0)
    ]
    assert live == []  # the refused worker's registration was rolled back

    # The new policy under a new version is fine.
    third = Registry()
    third.task("charge", version=2, retry=RetryPolicy.fixed(6.0))(lambda ctx, payload: None)
    async with running_worker(third, pgtask_database_url, FAST):
        pass


# -- shutdown ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_shutdown_hands_back_a_task_that_outlives_the_grace_period(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, kind: str
) -> None:
    registry = Registry()
    started = threading.Event()
    finally_ran = threading.Event()
    unblock = threading.Event()

    if kind == "async":
        @registry.task("slow")
        async def slow_async(ctx: TaskContext, payload: None) -> str:
            started.set()
            try:
                await asyncio.wait_for(asyncio.Event().wait(), 30)
            finally:
                finally_ran.set()
            return "too late"
    else:
        @registry.task("slow")
        def slow_sync(ctx: SyncTaskContext, payload: None) -> str:
            started.set()
            unblock.wait(timeout=30)
            finally_ran.set()
            return "too late"

    task_id = await add(pgtask_async_engine, "slow", max_attempts=1)
    options = WorkerOptions(lease_duration=LEASE, shutdown_grace=0.3)
    try:
        async with running_worker(registry, pgtask_database_url, options):
            await wait_event(started)
        row = await task_row(pgtask_async_engine, task_id)
    finally:
        unblock.set()
    if kind == "async":
        assert finally_ran.is_set()  # the coroutine was cancelled before the worker returned
    # Handed back: pending again, and not a failure (max_attempts=1 would end it otherwise).
    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("pending", 1, 0)
    assert row["lease_token"] is None
    assert row["result"] is None
    if kind == "async":
        assert row["run_at"] == row["updated_at"]  # due again at once
    else:
        # The thread still runs: due again only when its lease could have expired, so no
        # other worker starts it while this one still runs it.
        assert row["run_at"] == row["updated_at"] + timedelta(seconds=LEASE)
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    assert attempt["state"] == "released"
    assert attempt["finished_at"] == row["updated_at"]
    # The sync thread finishing afterwards writes nothing.
    await wait_until(finally_ran.is_set, PATIENCE, message="the handler thread ended")
    assert await task_row(pgtask_async_engine, task_id) == row


async def test_shutdown_drains_a_handler_that_finishes_within_the_grace_period(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    started, finish = asyncio.Event(), asyncio.Event()
    lease = 0.9

    @registry.task("finishing")
    async def finishing(ctx: TaskContext, payload: None) -> str:
        started.set()
        await asyncio.wait_for(finish.wait(), 20)
        return "finished while draining"

    task_id = await add(pgtask_async_engine, "finishing")
    late_id: uuid.UUID | None = None
    options = WorkerOptions(lease_duration=lease, shutdown_grace=15.0)

    async def finish_once_draining(worker: Worker) -> None:
        nonlocal late_id

        async def marked_draining() -> bool:
            async with pgtask_async_engine.connect() as conn:
                return bool(
                    (
                        await conn.execute(
                            select(WorkerRecord.draining).where(WorkerRecord.id == worker.id)
                        )
                    ).scalar_one()
                )

        # Operators see the worker draining while it still works.
        await wait_until(marked_draining, 10, message="the worker row says draining")
        # Enqueued while draining: a draining worker claims nothing new.
        late_id = await add(pgtask_async_engine, "finishing")
        # Leases are still renewed during the grace period: outlive two of them.
        since = await db_now(pgtask_async_engine)

        async def two_leases_passed() -> bool:
            row = await task_row(pgtask_async_engine, task_id)
            assert (row["state"], row["attempt"]) == ("running", 1), "the lease was lost"
            return bool(await db_now(pgtask_async_engine) > since + timedelta(seconds=2 * lease))

        await wait_until(two_leases_passed, 10, message="two lease durations while draining")
        finish.set()

    async with running_worker(registry, pgtask_database_url, options) as worker:
        await wait_event(started)
        helper = asyncio.create_task(finish_once_draining(worker))
    await helper  # the worker returned only after the handler finished
    row = await task_row(pgtask_async_engine, task_id)
    assert (row["state"], row["result"]) == ("succeeded", "finished while draining")
    assert (row["attempt"], row["failed_attempts"]) == (1, 0)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
        "succeeded"
    ]
    assert late_id is not None
    late = await task_row(pgtask_async_engine, late_id)
    assert (late["state"], late["attempt"]) == ("pending", 0)


async def test_claims_and_outcome_writes_go_to_the_driver_as_text_compiled_once(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()

    @registry.task("echo", timeout=30.0)
    async def echo(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
        if payload["fail"]:
            raise Fail("no")
        return {"got": payload, "headers": ctx.headers}

    ids = [
        await add(pgtask_async_engine, "echo", {"i": i, "fail": i == 2}, headers={"h": str(i)})
        for i in range(4)
    ]
    texts: dict[str, str] = {}
    async with pgtask_async_engine.connect() as connection:
        for name, statement in (
            ("claim", statements.CLAIM), ("complete", statements.COMPLETE),
            ("fail", statements.FAIL),
        ):
            prepared = driver_statement(connection, statement)
            assert prepared is not None
            texts[prepared.sql] = name
    sent: list[tuple[str, Any]] = []
    event.listen(
        pgtask_async_engine.sync_engine, "before_cursor_execute",
        lambda c, cur, text, p, ctx, m: sent.append((text, ctx.compiled)),
    )
    async with running_worker(registry, pgtask_async_engine, FAST):
        rows = [await wait_for_state(pgtask_async_engine, task_id) for task_id in ids]
    # The claimed row's JSON, headers, lease and time limit arrive decoded as before.
    assert [row["state"] for row in rows] == ["succeeded", "succeeded", "failed", "succeeded"]
    assert rows[0]["result"] == {"got": {"i": 0, "fail": False}, "headers": {"h": "0"}}
    assert rows[2]["error"]["message"] == "no"
    kinds = [(texts[text], compiled) for text, compiled in sent if text in texts]
    assert {kind for kind, _ in kinds} == {"claim", "complete", "fail"}
    # Every one sent as text, not compiled per execution.
    assert [compiled for _, compiled in kinds] == [None] * len(kinds)


# -- idleness and scheduling ---------------------------------------------------------------


async def test_an_idle_worker_does_not_busy_poll(pgtask_async_engine: AsyncEngine) -> None:
    registry = Registry()
    registry.task("known")(lambda ctx, payload: None)
    # Due work this worker cannot run must not make it spin either.
    await add(pgtask_async_engine, "unknown")
    executed: list[tuple[float, str]] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        executed.append((time.monotonic(), statement))

    event.listen(pgtask_async_engine.sync_engine, "before_cursor_execute", count)
    options = WorkerOptions(lease_duration=3.0, heartbeat_interval=1.0, worker_ttl=3.0)
    async with running_worker(registry, pgtask_async_engine, options):
        # The claim loop has gone idle once it asked when the next task is due.
        await wait_until(
            lambda: any("EXTRACT(epoch" in s for _, s in executed), 5,
            message="the first idle pass",
        )
        window_start = time.monotonic()
        await asyncio.sleep(1.5)  # the measurement window, not a synchronisation
        window = [s for t, s in executed if t >= window_start]
    # A busy loop repeats one statement hundreds of times. The periodic services repeat theirs
    # at most about twice here (recovery every lease/3, the heartbeat every second), and the
    # maintenance services' first passes (schedules, retention, idempotency keys) run once
    # each but may land in the window on a slow machine, so count repeats per statement.
    repeats = Counter(window)
    assert max(repeats.values(), default=0) <= 3, [
        (s.split()[0:4], n) for s, n in repeats.most_common(3)
    ]
    assert len(window) <= 40, [s.split()[0:3] for s in window]


async def test_a_delayed_task_runs_at_its_database_run_at_without_waiting_for_the_poll(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("later")
    async def later(ctx: TaskContext, payload: None) -> str:
        return "on time"

    async with running_worker(registry, pgtask_database_url, SLOW):
        task_id = await add(pgtask_async_engine, "later", delay=3600)
        # To a second before run_at: the move wakes the worker, which finds the task due in a
        # second; only its own timer for run_at wakes it then (no notification, and a poll
        # interval far longer than the deadline).
        pgtask_clock.advance(3600 - 1)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    assert row["run_at"] == row["created_at"] + timedelta(seconds=3600)
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    # Never early by the database's clock.
    assert attempt["started_at"] >= row["run_at"]


async def test_a_shutdown_requested_before_run_makes_run_return_after_startup(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("never-claimed")
    async def never_claimed(ctx: TaskContext, payload: None) -> None:
        raise AssertionError("nothing should be claimed after a shutdown request")

    task_id = await add(pgtask_async_engine, "never-claimed")
    worker = Worker(registry, pgtask_database_url, FAST)
    worker.shutdown()
    await asyncio.wait_for(worker.run(), 30)
    assert (await task_row(pgtask_async_engine, task_id))["attempt"] == 0
