"""Time limits: a per-definition or per-enqueue ``timeout`` stops an attempt that runs past it.

The claim writes the attempt's deadline in database time (claim time + the limit); the worker
stops an ``async def`` handler by cancelling it, flags a ``def`` handler (``ctx.cancelled``)
and fences out whatever it returns later; the attempt fails with kind ``timeout`` and is
retried by the task's policy.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    InvalidOptionError,
    Registry,
    RetryPolicy,
    SyncTaskContext,
    Task,
    TaskContext,
    WorkerOptions,
    enqueue,
    enqueue_many,
)
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE, wait_event

LEASE = 1.5
OPTIONS = WorkerOptions(lease_duration=LEASE, shutdown_grace=2.0)
NO_WAIT = RetryPolicy.fixed(0.0, jitter=False)


def error_types(attempts: list[dict[str, Any]]) -> list[str | None]:
    return [None if a["error"] is None else a["error"]["type"] for a in attempts]


async def test_an_async_handler_past_its_definitions_limit_is_cancelled_and_retried(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    cancelled = 0

    @registry.task("slow", timeout=0.3, retry=NO_WAIT, max_attempts=2)
    async def slow(ctx: TaskContext, payload: None) -> str:
        nonlocal cancelled
        try:
            await asyncio.sleep(PATIENCE)
        except asyncio.CancelledError:
            cancelled += 1
            raise
        return "never"

    task_id = await add(pgtask_async_engine, "slow")
    async with running_worker(registry, pgtask_async_engine, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "failed"
    assert row["error"]["type"] == "timeout"
    assert (row["attempt"], row["failed_attempts"]) == (2, 2)
    assert cancelled == 2  # both attempts were stopped, and retried by the policy in between
    attempts = await attempt_rows(pgtask_async_engine, task_id)
    assert [a["state"] for a in attempts] == ["failed", "failed"]
    assert error_types(attempts) == ["timeout", "timeout"]
    for attempt in attempts:
        # The deadline is database time: the claim's own timestamp plus the limit.
        assert attempt["deadline_at"] == attempt["started_at"] + timedelta(seconds=0.3)
        assert attempt["finished_at"] >= attempt["deadline_at"]


async def test_a_per_enqueue_timeout_overrides_the_handlers(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()

    @registry.task("bounded", timeout=PATIENCE, retry=NO_WAIT, max_attempts=1)
    async def bounded(ctx: TaskContext, payload: None) -> None:
        await asyncio.sleep(PATIENCE)

    short = await add(pgtask_async_engine, "bounded", timeout=0.2)
    async with running_worker(registry, pgtask_async_engine, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, short, timeout=PATIENCE)
    assert (row["state"], row["error"]["type"]) == ("failed", "timeout")
    assert row["timeout_seconds"] == 0.2


async def test_a_handler_within_its_limit_succeeds_and_records_its_deadline(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()

    @registry.task("quick", timeout=30.0)
    async def quick(ctx: TaskContext, payload: None) -> str:
        return "done"

    no_limit_registry = Registry()
    no_limit_registry.task("free")(lambda ctx, payload: "free")
    task_id = await add(pgtask_async_engine, "quick")
    free_id = await add(pgtask_async_engine, "free")
    async with running_worker(registry, pgtask_async_engine, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    async with running_worker(no_limit_registry, pgtask_async_engine, OPTIONS):
        await wait_for_state(pgtask_async_engine, free_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", "done")
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    assert attempt["deadline_at"] == attempt["started_at"] + timedelta(seconds=30)
    [free] = await attempt_rows(pgtask_async_engine, free_id)
    assert free["deadline_at"] is None


async def test_a_sync_handler_past_its_limit_is_flagged_and_its_late_result_fenced_out(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    release = threading.Event()
    saw_cancelled = threading.Event()
    started = threading.Event()

    @registry.task("blocking", timeout=0.3, retry=NO_WAIT, max_attempts=1)
    def blocking(ctx: SyncTaskContext, payload: None) -> str:
        started.set()
        release.wait(PATIENCE)
        if ctx.cancelled:
            saw_cancelled.set()
        return "late"

    task_id = await add(pgtask_async_engine, "blocking")
    async with running_worker(registry, pgtask_async_engine, OPTIONS):
        await wait_event(started, PATIENCE)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        # Recorded while the thread still runs: the limit does not wait for the handler.
        assert not release.is_set()
        release.set()
        await wait_event(saw_cancelled, PATIENCE)
        # Let the late return reach the event loop, then check nothing was written for it.
        await asyncio.sleep(0.2)
        after = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["error"]["type"]) == ("failed", "timeout")
    assert (after["state"], after["result"], after["error"]) == ("failed", None, row["error"])
    assert error_types(await attempt_rows(pgtask_async_engine, task_id)) == ["timeout"]


async def test_a_sync_handler_past_its_limit_is_retried_no_sooner_than_a_lease(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    release = threading.Event()

    @registry.task("stuck", timeout=0.2, retry=NO_WAIT, max_attempts=3)
    def stuck(ctx: SyncTaskContext, payload: None) -> None:
        release.wait(PATIENCE)

    task_id = await add(pgtask_async_engine, "stuck")
    try:
        async with running_worker(registry, pgtask_async_engine, OPTIONS):
            async def retrying() -> bool:
                row = await task_row(pgtask_async_engine, task_id)
                return bool(row["state"] == "pending" and row["attempt"] == 1)

            await wait_until(retrying, PATIENCE, message="the retry is scheduled")
            row = await task_row(pgtask_async_engine, task_id)
            # Its thread may still run: the retry waits at least a lease, not the policy's 0 s.
            async with pgtask_async_engine.connect() as conn:
                wait = (
                    await conn.execute(
                        select(Task.run_at - func.pgtask.now()).where(Task.id == task_id)
                    )
                ).scalar_one()
            assert row["error"]["type"] == "timeout"
            assert isinstance(wait, timedelta)
            assert wait > timedelta(seconds=LEASE / 2)
    finally:
        release.set()


def test_enqueue_many_keeps_each_requests_timeout(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        uniform = enqueue_many(
            conn, [EnqueueRequest(name="a", timeout=timedelta(minutes=2)) for _ in range(3)]
        )
        mixed = enqueue_many(
            conn, [EnqueueRequest(name="a", timeout=5), EnqueueRequest(name="a")]
        )
        keyed = enqueue_many(
            conn, [EnqueueRequest(name="a", timeout=7, idempotency_key="k")]
        )
        single = enqueue(conn, "a", timeout=1.5)
        limits = {row.id: row.timeout_seconds for row in conn.execute(select(Task))}
    assert [limits[r.id] for r in uniform] == [120.0] * 3
    assert [limits[r.id] for r in mixed] == [5.0, None]
    assert [limits[r.id] for r in keyed] == [7.0]
    assert limits[single.id] == 1.5


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", True, timedelta(0)])
def test_a_bad_timeout_is_refused_before_any_sql(pgtask_engine: Engine, bad: object) -> None:
    with pgtask_engine.begin() as conn:
        with pytest.raises(InvalidOptionError, match="timeout"):
            enqueue(conn, "a", timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match=r"\[0\]\.timeout"):
            enqueue_many(conn, [EnqueueRequest(name="a", timeout=bad)])  # type: ignore[arg-type]
        assert conn.execute(select(func.count()).select_from(Task)).scalar_one() == 0
    with pytest.raises(InvalidOptionError, match="timeout"):
        Registry().task("t", timeout=bad)  # type: ignore[arg-type]


def test_the_timeout_error_document_says_what_happened(pgtask_engine: Engine) -> None:
    from sqlalchemy_pgtask.outcome import decide

    outcome = decide(
        raised=asyncio.CancelledError(), stop="timeout", stopped_by_worker=True,
        policy=RetryPolicy.fixed(3.0, jitter=False), failed_attempts=0,
    )
    assert outcome is not None
    assert (outcome.kind, outcome.error_kind, outcome.delay) == ("fail", "timeout", 3.0)
    assert json.loads(outcome.document or "{}") == {"type": "timeout"}
