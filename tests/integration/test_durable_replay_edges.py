"""Replays at the edges: a sleep resumed before its wake time, and durable calls that can never
replay (a changed call under a step name, a step name used twice), which fail the task at once.

Each test runs a real worker against its own database; time moves with the database clock.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from sqlalchemy_pgtask import (
    Checkpoint,
    Registry,
    ReplayMismatch,
    RetryPolicy,
    SyncTaskContext,
    TaskContext,
    WorkerOptions,
    cancel_async,
    retry_async,
)
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)


async def _attempts_ended(engine: AsyncEngine, task_id: uuid.UUID, count: int) -> list[str]:
    """The task's attempt states once ``count`` attempts have ended."""

    async def ended() -> bool:
        states = [a["state"] for a in await attempt_rows(engine, task_id)]
        return len(states) >= count and states[count - 1] != "running"

    await wait_until(ended, PATIENCE, message=f"{count} attempts to end")
    return [a["state"] for a in await attempt_rows(engine, task_id)]


async def _stored_wake_time(engine: AsyncEngine, task_id: uuid.UUID) -> Any:
    async with AsyncSession(engine) as session:
        stored = (
            await session.scalars(select(Checkpoint).where(Checkpoint.task_id == task_id))
        ).one()
        return stored.wake_at


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_retried_sleep_sleeps_until_its_stored_wake_time(
    kind: str,
    pgtask_database_url: str,
    pgtask_async_engine: AsyncEngine,
    pgtask_clock: DatabaseClock,
) -> None:
    # A task cancelled during sleep_for("nap", 3600) and then retried replays the sleep: its
    # checkpoint exists, but the hour is not over, so the retry must sleep the rest of it
    # (it returned at once and the task finished 80 ms after the retry).
    registry = Registry()
    woke = threading.Event()

    if kind == "async":
        @registry.task("napper")
        async def napper(ctx: TaskContext, payload: None) -> str:
            await ctx.sleep_for("nap", 3600)
            woke.set()
            return "rested"
    else:
        @registry.task("napper")
        def sync_napper(ctx: SyncTaskContext, payload: None) -> str:
            ctx.sleep_for("nap", 3600)
            woke.set()
            return "rested"

    task_id = await add(pgtask_async_engine, "napper")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        assert await _attempts_ended(pgtask_async_engine, task_id, 1) == ["suspended"]
        wake_at = await _stored_wake_time(pgtask_async_engine, task_id)
        async with pgtask_async_engine.begin() as conn:
            assert await cancel_async(conn, task_id) == "cancelled"
        async with pgtask_async_engine.begin() as conn:
            await retry_async(conn, task_id)
        # The retry is claimed at once, replays the sleep, and sleeps again until the hour
        # the first attempt stored.
        assert await _attempts_ended(pgtask_async_engine, task_id, 2) == [
            "suspended", "suspended",
        ]
        row = await task_row(pgtask_async_engine, task_id)
        assert (row["state"], row["run_at"]) == ("pending", wake_at)
        assert not woke.is_set()
        pgtask_clock.advance(3600)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"], row["attempt"]) == ("succeeded", "rested", 3)
    assert await _stored_wake_time(pgtask_async_engine, task_id) == wake_at


AGAIN = RetryPolicy.fixed(0.0, jitter=False)


async def _failed_at_once(
    registry: Registry, url: str, engine: AsyncEngine, task_id: uuid.UUID
) -> dict[str, Any]:
    async with running_worker(registry, url, OPTIONS):
        row = await wait_for_state(engine, task_id, timeout=PATIENCE)
    return row


@pytest.mark.parametrize("wrapped", [False, True])
async def test_a_replay_mismatch_fails_the_task_at_once(
    wrapped: bool, pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    # The mismatch is deterministic: every retry meets the same checkpoint. It was retried by
    # policy until max_attempts ran out. A handler that wraps it in its own error changes
    # nothing (an explicit Retry would be obeyed: tests/unit/test_decide.py).
    registry = Registry()
    # The attempts the handler ran in: a claim cut short under load hands its task back
    # unrun, spending an attempt number, so "the first run" is not ``ctx.attempt == 1``.
    runs: list[int] = []

    @registry.task("changed", max_attempts=5, retry=AGAIN)
    async def changed(ctx: TaskContext, payload: None) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            await ctx.step("charge", lambda: "charged")
            raise RuntimeError("fails once, so the next attempt replays")
        try:
            await ctx.sleep_for("charge", 1)  # as if the code changed under the running task
        except ReplayMismatch as exc:
            if wrapped:
                raise LookupError("the workflow could not go on") from exc
            raise
        return "never"

    task_id = await add(pgtask_async_engine, "changed")
    row = await _failed_at_once(registry, pgtask_database_url, pgtask_async_engine, task_id)
    # Failed by the run that met the mismatch, never retried after it.
    assert len(runs) == 2
    assert (row["state"], row["attempt"]) == ("failed", runs[-1])
    assert row["error"]["type"] == "replay_mismatch"
    assert row["error"]["exception"] == (
        "LookupError" if wrapped else "sqlalchemy_pgtask.errors.ReplayMismatch"
    )
    assert wrapped or "charge" in row["error"]["message"]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_step_name_used_twice_fails_the_task_at_once(
    kind: str, pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    if kind == "async":
        @registry.task("twice", max_attempts=5, retry=AGAIN)
        async def twice(ctx: TaskContext, payload: None) -> None:
            await ctx.step("fetch", lambda: 1)
            await ctx.step("fetch", lambda: 2)
    else:
        @registry.task("twice", max_attempts=5, retry=AGAIN)
        def sync_twice(ctx: SyncTaskContext, payload: None) -> None:
            ctx.step("fetch", lambda: 1)
            ctx.step("fetch", lambda: 2)

    task_id = await add(pgtask_async_engine, "twice")
    row = await _failed_at_once(registry, pgtask_database_url, pgtask_async_engine, task_id)
    assert (row["state"], row["attempt"]) == ("failed", 1)
    assert row["error"]["type"] == "duplicate_step"
    assert row["error"]["exception"] == "sqlalchemy_pgtask.errors.DuplicateStep"
