"""``ctx.spawn(..., timeout=)``: a child's time limit, taken and checked as `enqueue` takes it.

The child's attempt is stopped past its limit and fails with kind ``timeout`` exactly as an
enqueued task's does; a bad limit is refused with `enqueue`'s error before anything is written
(the step key stays free); and a replay returns the child first spawned even when the code
now passes another limit: options are not part of a spawn's identity.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    Checkpoint,
    InvalidOptionError,
    Registry,
    Retry,
    RetryPolicy,
    SyncTaskContext,
    Task,
    TaskContext,
    WorkerOptions,
    enqueue,
)
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import add, task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
NO_WAIT = RetryPolicy.fixed(0.0, jitter=False)

#: Limits `enqueue` refuses, each with `InvalidOptionError` on ``timeout``.
BAD_LIMITS: list[Any] = [0, -1.0, timedelta(0), "soon", True, float("nan"), 10.0**12]


def slow_child(registry: Registry) -> None:
    """A child that would run for `PATIENCE` unless its time limit stops it."""

    @registry.task("slow-child", retry=NO_WAIT, max_attempts=1, timeout=PATIENCE)
    async def slow(ctx: TaskContext, payload: None) -> str:
        await asyncio.sleep(PATIENCE)
        return "never"


async def run_to_the_end(
    registry: Registry, url: str, engine: AsyncEngine, name: str
) -> dict[str, Any]:
    """Enqueue a ``name`` task, run a worker until it ends, and return its row."""
    task_id = await add(engine, name)
    async with running_worker(registry, url, OPTIONS):
        return await wait_for_state(engine, task_id, timeout=PATIENCE)


async def children_of(engine: AsyncEngine, parent: uuid.UUID) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(select(Task.__table__).where(Task.parent_id == parent))
        return [dict(row) for row in rows.mappings()]


async def test_an_async_parents_child_is_stopped_by_its_spawn_time_limit(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    slow_child(registry)

    @registry.task("async-parent", retry=NO_WAIT, max_attempts=1)
    async def parent(ctx: TaskContext, payload: None) -> Any:
        child = await ctx.spawn("child", "slow-child", timeout=0.2)
        ended = await ctx.wait_for_result("wait", child)
        return [ended.state, (ended.error or {}).get("type")]

    row = await run_to_the_end(registry, pgtask_database_url, pgtask_async_engine, "async-parent")
    assert (row["state"], row["result"]) == ("succeeded", ["failed", "timeout"]), row["error"]
    [child] = await children_of(pgtask_async_engine, row["id"])
    assert (child["state"], child["timeout_seconds"]) == ("failed", 0.2)
    assert child["error"]["type"] == "timeout"


async def test_a_sync_parents_child_takes_a_timedelta_limit(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    slow_child(registry)

    @registry.task("sync-parent", retry=NO_WAIT, max_attempts=1)
    def parent(ctx: SyncTaskContext, payload: None) -> Any:
        child = ctx.spawn("child", "slow-child", timeout=timedelta(milliseconds=300))
        ended = ctx.wait_for_result("wait", child)
        return [ended.state, (ended.error or {}).get("type")]

    row = await run_to_the_end(registry, pgtask_database_url, pgtask_async_engine, "sync-parent")
    assert (row["state"], row["result"]) == ("succeeded", ["failed", "timeout"]), row["error"]
    [child] = await children_of(pgtask_async_engine, row["id"])
    assert (child["state"], child["timeout_seconds"]) == ("failed", 0.3)


async def test_without_a_limit_the_childs_handler_limit_applies(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("bounded-child", retry=NO_WAIT, max_attempts=1, timeout=0.2)
    async def bounded(ctx: TaskContext, payload: None) -> None:
        await asyncio.sleep(PATIENCE)

    @registry.task("plain-parent", retry=NO_WAIT, max_attempts=1)
    async def parent(ctx: TaskContext, payload: None) -> Any:
        child = await ctx.spawn("child", bounded)
        return (await ctx.wait_for_result("wait", child)).state

    row = await run_to_the_end(registry, pgtask_database_url, pgtask_async_engine, "plain-parent")
    assert (row["state"], row["result"]) == ("succeeded", "failed"), row["error"]
    [child] = await children_of(pgtask_async_engine, row["id"])
    assert (child["timeout_seconds"], child["error"]["type"]) == (None, "timeout")


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
def test_enqueue_refuses_each_bad_limit_the_spawn_tests_use(
    pgtask_engine: Engine, limit: Any
) -> None:
    with pgtask_engine.connect() as conn, pytest.raises(InvalidOptionError) as refused:
        enqueue(conn, "job", timeout=limit)
    assert refused.value.field == "timeout"


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
async def test_a_bad_limit_is_refused_before_anything_is_written(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, is_async: bool
) -> None:
    refused: list[tuple[str, str]] = []
    registry = Registry()
    registry.task("quick-child")(lambda ctx, payload: "done")

    if is_async:
        @registry.task("checked-parent", retry=NO_WAIT, max_attempts=1)
        async def checked(ctx: TaskContext, payload: None) -> str:
            for limit in BAD_LIMITS:
                try:
                    await ctx.spawn("child", "quick-child", timeout=limit)
                except InvalidOptionError as exc:
                    refused.append((exc.field, type(exc).__name__))
            # The refused calls left the step key free for a valid one.
            return str(await ctx.spawn("child", "quick-child", timeout=5))
    else:
        @registry.task("checked-parent", retry=NO_WAIT, max_attempts=1)
        def checked_sync(ctx: SyncTaskContext, payload: None) -> str:
            for limit in BAD_LIMITS:
                try:
                    ctx.spawn("child", "quick-child", timeout=limit)
                except InvalidOptionError as exc:
                    refused.append((exc.field, type(exc).__name__))
            return str(ctx.spawn("child", "quick-child", timeout=5))

    row = await run_to_the_end(registry, pgtask_database_url, pgtask_async_engine, "checked-parent")
    assert row["state"] == "succeeded", row["error"]
    assert refused == [("timeout", "InvalidOptionError")] * len(BAD_LIMITS)
    [child] = await children_of(pgtask_async_engine, row["id"])
    assert (str(child["id"]), child["timeout_seconds"]) == (row["result"], 5.0)
    async with pgtask_async_engine.connect() as conn:
        checkpoints = (await conn.execute(
            select(func.count()).where(Checkpoint.task_id == row["id"])
        )).scalar_one()
    assert checkpoints == 1


async def test_a_replay_with_another_limit_returns_the_child_first_spawned(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    spawned: list[uuid.UUID] = []
    registry = Registry()
    registry.task("quick-child")(lambda ctx, payload: "done")

    @registry.task("changing", retry=NO_WAIT, max_attempts=2)
    async def changing(ctx: TaskContext, payload: None) -> Any:
        # As if the code changed between attempts: the limit is not compared on replay.
        limit = 30.0 if ctx.attempt == 1 else timedelta(minutes=5)
        spawned.append(await ctx.spawn("child", "quick-child", timeout=limit))
        if ctx.attempt == 1:
            raise Retry("replay the spawn")
        return (await ctx.wait_for_result("wait", spawned[-1])).state

    row = await run_to_the_end(registry, pgtask_database_url, pgtask_async_engine, "changing")
    assert (row["state"], row["result"]) == ("succeeded", "succeeded"), row["error"]
    assert spawned == [spawned[0], spawned[0]]
    child = await task_row(pgtask_async_engine, spawned[0])
    assert child["timeout_seconds"] == 30.0  # as first spawned
