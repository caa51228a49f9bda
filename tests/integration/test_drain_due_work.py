"""`drain` runs what a real worker would run: work that the worker's maintenance passes make
due (a wait whose timeout has passed, a schedule whose occurrence is due) counts as due work,
so a test that moves the clock past such a deadline and drains sees the handler run, every
time, instead of whenever the pass happens to beat drain's first look.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import Registry, Task, TaskContext, enqueue, pause_queue, set_schedule
from sqlalchemy_pgtask.testing import DatabaseClock, drain

registry = Registry()


@registry.task("approve-order")
async def approve_order(ctx: TaskContext, payload: Any) -> dict[str, Any]:
    approval = await ctx.wait_for_signal("approval", "approved", timeout=60)
    return {"approval": approval}


@registry.schedule("hourly-report", every=3600)
@registry.task("hourly-report")
async def hourly_report(ctx: TaskContext, payload: Any) -> str:
    return "reported"


@registry.task("nightly-cleanup")
async def nightly_cleanup(ctx: TaskContext, payload: Any) -> str:
    return "cleaned"


def _state(engine: Engine, task_id: uuid.UUID) -> str:
    with Session(engine) as session:
        task = session.get(Task, task_id)
        assert task is not None
        return task.state


def _succeeded(engine: Engine, name: str) -> int:
    with Session(engine) as session:
        count = session.scalar(
            select(func.count()).select_from(Task).where(
                Task.name == name, Task.state == "succeeded"
            )
        )
    return int(count or 0)


async def test_drain_runs_a_task_whose_signal_wait_timed_out(
    pgtask_engine: Engine, pgtask_database_url: str, pgtask_clock: DatabaseClock
) -> None:
    with Session(pgtask_engine) as session, session.begin():
        task_id = approve_order.enqueue(session, {}).id
    await drain(registry, pgtask_database_url)
    assert _state(pgtask_engine, task_id) == "waiting"

    pgtask_clock.advance(61)
    # While the wait cannot be timed out (its row is held), the timeout is still due work:
    # drain must not report the queue idle.
    with pgtask_engine.connect() as holder:
        holder.execute(
            text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE"), {"id": task_id}
        )
        with pytest.raises(TimeoutError):
            await drain(registry, pgtask_database_url, timeout=1.5)
        holder.rollback()
    assert _state(pgtask_engine, task_id) == "waiting"

    await drain(registry, pgtask_database_url)
    assert _state(pgtask_engine, task_id) == "succeeded"


async def test_drain_materialises_and_runs_a_due_schedule(
    pgtask_engine: Engine, pgtask_database_url: str, pgtask_clock: DatabaseClock
) -> None:
    with Session(pgtask_engine) as session, session.begin():
        set_schedule(session, "nightly", task=nightly_cleanup, every=86400)
    pgtask_clock.advance(86400)
    # The schedule is due but held by another materialiser: still due work.
    with pgtask_engine.connect() as holder:
        holder.execute(text("SELECT 1 FROM pgtask.schedules WHERE name = 'nightly' FOR UPDATE"))
        with pytest.raises(TimeoutError):
            await drain(registry, pgtask_database_url, timeout=1.5)
        holder.rollback()
    assert _succeeded(pgtask_engine, "nightly-cleanup") == 0

    await drain(registry, pgtask_database_url)
    assert _succeeded(pgtask_engine, "nightly-cleanup") == 1


@pytest.mark.parametrize("hour", range(3))
async def test_drain_after_the_clock_passes_a_declared_schedule_runs_its_occurrence(
    pgtask_engine: Engine, pgtask_database_url: str, pgtask_clock: DatabaseClock, hour: int
) -> None:
    await drain(registry, pgtask_database_url)  # the worker declares the schedule
    before = _succeeded(pgtask_engine, "hourly-report")
    pgtask_clock.advance(3600)
    await drain(registry, pgtask_database_url)
    assert _succeeded(pgtask_engine, "hourly-report") == before + 1


async def test_drain_leaves_the_tasks_of_a_paused_queue_and_returns(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    # A worker never claims from a paused queue: drain waited for those tasks until its
    # timeout and raised TimeoutError, though everything it could run had run.
    with Session(pgtask_engine) as session:
        pause_queue(session, "held", actor="test", reason="maintenance")
        held = enqueue(session, "nightly-cleanup", queue="held").id
        ran = enqueue(session, "nightly-cleanup", queue="open").id
        session.commit()
    tasks = Registry()
    for queue in ("held", "open"):
        tasks.task("nightly-cleanup", queue=queue)(nightly_cleanup)

    await drain(tasks, pgtask_database_url, timeout=5)

    assert _state(pgtask_engine, ran) == "succeeded"
    assert _state(pgtask_engine, held) == "pending"
