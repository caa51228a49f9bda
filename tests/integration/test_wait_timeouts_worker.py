"""With a real worker: an unrelated 2 s signal timeout fires while another wait timeout's
subtree is held by an open application transaction (a ``cancel()`` of a grandchild, not
committed). Before, every wait-timeout pass failed on ``lock_timeout`` while that transaction
lasted, and the signal timeout waited with it. Real time, real row lock, a real `Worker`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions, cancel
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import add, wait_for_state
from tests.support.trees import add_chain
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(
    lease_duration=6.0, shutdown_grace=2.0, poll_interval=0.5, lock_timeout=0.3
)


async def test_an_unrelated_signal_timeout_fires_while_another_timeouts_subtree_is_held(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    children: list[Any] = []

    @registry.task("ship", max_attempts=1)
    async def ship(ctx: TaskContext, payload: None) -> Any:
        return await ctx.wait_for_signal("approval", "go")

    @registry.task("order", max_attempts=1)
    async def order(ctx: TaskContext, payload: None) -> Any:
        child = await ctx.spawn("spawn-ship", ship, None)
        children.append(child)
        result = await ctx.wait_for_result("wait-ship", child, timeout=1.0)
        return result.state

    @registry.task("impatient", max_attempts=1)
    async def impatient(ctx: TaskContext, payload: None) -> Any:
        return {"got": await ctx.wait_for_signal("approve", "approved", timeout=2.0)}

    parent = await add(pgtask_async_engine, "order")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, parent, ["waiting"], timeout=PATIENCE)
        await wait_for_state(pgtask_async_engine, children[0], ["waiting"], timeout=PATIENCE)
        with pgtask_engine.connect() as setup:
            [grandchild] = add_chain(setup, children[0], 1)  # no worker serves its name
            setup.commit()
        with pgtask_engine.connect() as holder:
            assert cancel(holder, grandchild) == "cancelled"  # held until the rollback
            unrelated = await add(pgtask_async_engine, "impatient")
            row = await wait_for_state(pgtask_async_engine, unrelated, timeout=PATIENCE)
            assert (row["state"], row["result"]) == ("succeeded", {"got": None})
            still = await wait_for_state(pgtask_async_engine, parent, ["waiting"], timeout=1.0)
            assert still["state"] == "waiting"
            holder.rollback()
        done = await wait_for_state(pgtask_async_engine, parent, timeout=PATIENCE)
    assert (done["state"], done["result"]) == ("succeeded", "timeout")
    ended = await wait_for_state(pgtask_async_engine, grandchild, timeout=PATIENCE)
    assert ended["state"] == "cancelled"
