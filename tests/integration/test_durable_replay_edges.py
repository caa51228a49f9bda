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
