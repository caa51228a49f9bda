"""The outcome writer under faults: one outcome that cannot be written now (its waiting parent
held by another transaction, a statement cut short) never holds back the others.

Each test makes the fault for real: a row lock held by another connection, a statement that
runs past the worker's ``statement_timeout``.
"""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state

FAST = WorkerOptions(lease_duration=3.0, poll_interval=30.0, shutdown_grace=2.0)


async def test_an_outcome_whose_waiting_parent_is_locked_does_not_hold_back_other_outcomes(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    child_go = asyncio.Event()
    children: list[uuid.UUID] = []

    @registry.task("parent")
    async def parent(ctx: TaskContext, payload: None) -> str:
        kid = await ctx.spawn("spawn", "child")
        done = await ctx.wait_for_result("wait", kid)
        return str(done.state)

    @registry.task("child")
    async def child(ctx: TaskContext, payload: None) -> str:
        children.append(ctx.task_id)
        await child_go.wait()
        return "child done"

    @registry.task("other")
    async def other(ctx: TaskContext, payload: None) -> str:
        return "other done"

    parent_id = await add(pgtask_async_engine, "parent")
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        await wait_until(lambda: len(children) == 1, message="the child to start")
        await wait_for_state(pgtask_async_engine, parent_id, ("waiting",))
        async with pgtask_async_engine.connect() as holder:
            # A business transaction holds the waiting parent's row: the child's completion
            # cannot wake it now (55P03) and must be written later.
            await holder.execute(
                text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR NO KEY UPDATE"),
                {"id": parent_id},
            )
            child_go.set()
            # The child's outcome reaches the writer before the other task is even enqueued.
            await wait_until(lambda: worker.running_count == 0, message="the child to end")
            other_id = await add(pgtask_async_engine, "other")
            # While the parent stays locked, the unrelated outcome is written all the same.
            other_row = await wait_for_state(pgtask_async_engine, other_id, timeout=10)
            assert (await task_row(pgtask_async_engine, children[0]))["state"] == "running"
            await holder.rollback()
        child_row = await wait_for_state(pgtask_async_engine, children[0], timeout=30)
        parent_row = await wait_for_state(pgtask_async_engine, parent_id, timeout=30)

    assert (other_row["state"], other_row["result"]) == ("succeeded", "other done")
    assert (child_row["state"], child_row["attempt"]) == ("succeeded", 1)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, children[0])] == [
        "succeeded"
    ]
    assert parent_row["state"] == "succeeded"


_SLOW = """
CREATE FUNCTION slow_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Stands in for an outcome whose triggers run long (a large subtree to cancel).
    PERFORM pg_sleep(5);
    RETURN NEW;
END $$
---
CREATE TRIGGER slow_outcome BEFORE UPDATE OF state ON pgtask.tasks
    FOR EACH ROW WHEN (NEW.id = '{slow}' AND NEW.state = 'succeeded')
    EXECUTE FUNCTION slow_outcome()
"""


async def test_an_outcome_cut_short_by_statement_timeout_does_not_hold_back_other_outcomes(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    release = asyncio.Event()
    started: list[uuid.UUID] = []

    @registry.task("pair")
    async def pair(ctx: TaskContext, payload: None) -> int:
        started.append(ctx.task_id)
        await release.wait()  # both finish in the same moment: one batch
        return ctx.attempt

    slow = await add(pgtask_async_engine, "pair")
    quick = await add(pgtask_async_engine, "pair")
    async with pgtask_async_engine.begin() as conn:
        for statement in _SLOW.format(slow=slow).split("---"):
            await conn.exec_driver_sql(statement)
    options = WorkerOptions(
        lease_duration=3.0, poll_interval=30.0, shutdown_grace=2.0, statement_timeout=0.5
    )
    async with running_worker(registry, pgtask_database_url, options):
        await wait_until(lambda: len(started) == 2, message="both handlers to start")
        release.set()
        # The slow outcome's statement is cancelled every time it is tried; the quick one
        # is written all the same.
        quick_row = await wait_for_state(pgtask_async_engine, quick, timeout=10)
        assert (await task_row(pgtask_async_engine, slow))["state"] == "running"
        async with pgtask_async_engine.begin() as conn:
            await conn.exec_driver_sql("DROP TRIGGER slow_outcome ON pgtask.tasks")
        slow_row = await wait_for_state(pgtask_async_engine, slow, timeout=30)

    assert (quick_row["state"], quick_row["attempt"]) == ("succeeded", 1)
    assert (slow_row["state"], slow_row["attempt"]) == ("succeeded", 1)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, slow)] == ["succeeded"]
