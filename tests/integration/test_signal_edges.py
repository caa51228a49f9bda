"""What docs/durable.md says of signals sent to finished tasks, and of emitters that signal
several tasks in opposite orders; each statement there has its test here.

Finished tasks: a signal is stored and its value returned, nothing wakes and the task is
unchanged; a succeeded task never reads it, a cancelled or failed one reads it if it is
retried; it goes with its task, after which sending raises `TaskNotFound`.

Lock order, on real concurrent connections: two transactions that send the same signals to
two tasks in opposite orders deadlock (one is aborted with SQLSTATE 40P01, having written
nothing, and its retry returns what the other committed); in one order the second waits for
the first and returns its values; different signals never wait for each other.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, delete, func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Registry,
    RetryPolicy,
    Signal,
    Task,
    TaskContext,
    TaskNotFound,
    Wait,
    WorkerOptions,
    cancel,
    emit_signal,
    enqueue,
)
from sqlalchemy_pgtask.admin import retry
from sqlalchemy_pgtask.testing import running_worker
from tests.support.durable import Blocked
from tests.support.tasks import add, task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.2)
DEADLOCK = "40P01"


def signals_of(engine: Engine, task_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(select(Signal.name, Signal.value).where(Signal.task_id == task_id))
        return {row.name: row.value for row in rows}


def waiting_registry() -> Registry:
    registry = Registry()

    @registry.task("approve", retry=RetryPolicy.never())
    async def approve(ctx: TaskContext, payload: str) -> Any:
        return await ctx.wait_for_signal("wait", payload)

    @registry.task("instant")
    async def instant(ctx: TaskContext, payload: None) -> str:
        return "done"

    return registry


async def test_a_signal_to_a_succeeded_task_is_stored_and_never_read(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    task_id = await add(pgtask_async_engine, "instant")
    async with running_worker(waiting_registry(), pgtask_database_url, OPTIONS):
        before = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert before["state"] == "succeeded"
    with Session(pgtask_engine) as session:
        assert emit_signal(session, task_id, "late", {"n": 1}) == {"n": 1}
        assert emit_signal(session, task_id, "late", {"n": 2}) == {"n": 1}  # the first wins
        session.commit()
    assert signals_of(pgtask_engine, task_id) == {"late": {"n": 1}}
    assert await task_row(pgtask_async_engine, task_id) == before  # not touched at all


async def test_a_signal_to_a_cancelled_task_is_read_if_it_is_retried(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    task_id = await add(pgtask_async_engine, "approve", "approval")
    async with running_worker(waiting_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
        with Session(pgtask_engine) as session:
            cancel(session, task_id)
            session.commit()
        await wait_for_state(pgtask_async_engine, task_id, ["cancelled"], timeout=PATIENCE)
        with Session(pgtask_engine) as session:
            assert emit_signal(session, task_id, "approval", "yes") == "yes"
            session.commit()
        cancelled = await task_row(pgtask_async_engine, task_id)
        assert cancelled["state"] == "cancelled"  # nothing woke
        with pgtask_engine.connect() as conn:
            waits = conn.execute(select(func.count()).where(Wait.task_id == task_id))
            assert waits.scalar_one() == 0
        with Session(pgtask_engine) as session:
            retry(session, task_id)
            session.commit()
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    # The replay's wait finds the signal that arrived while the task was cancelled.
    assert (row["state"], row["result"]) == ("succeeded", "yes")


def test_a_deleted_tasks_signals_go_with_it_and_sending_again_is_refused(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        task_id = enqueue(session, "nobody-runs-this").id
        emit_signal(session, task_id, "late", 1)
        session.commit()
    with pgtask_engine.begin() as conn:  # as retention deletes a finished task
        conn.execute(delete(Task).where(Task.id == task_id))
    assert signals_of(pgtask_engine, task_id) == {}
    with Session(pgtask_engine) as session, pytest.raises(TaskNotFound):
        emit_signal(session, task_id, "late", 2)


def two_tasks(engine: Engine) -> tuple[uuid.UUID, uuid.UUID]:
    with Session(engine) as session:
        first = enqueue(session, "nobody-runs-this").id
        second = enqueue(session, "nobody-runs-this").id
        session.commit()
    return first, second


def sending(task_ids: tuple[uuid.UUID, ...], name: str, value: Any) -> Any:
    def send(conn: Connection) -> list[Any]:
        return [emit_signal(conn, task_id, name, value) for task_id in task_ids]

    return send


def sqlstate(exc: BaseException) -> str | None:
    return getattr(getattr(exc, "orig", None), "sqlstate", None)


def test_the_same_signals_sent_in_opposite_orders_deadlock_and_a_retry_is_safe(
    pgtask_engine: Engine,
) -> None:
    first, second = two_tasks(pgtask_engine)
    with pgtask_engine.connect() as observer, pgtask_engine.connect() as b:
        assert emit_signal(b, second, "go", "b") == "b"
        # A sends to `first`, then waits for B's uncommitted signal to `second` ...
        a = Blocked(pgtask_engine, observer, sending((first, second), "go", "a"))
        # ... and B, sending to `first` now, waits for A: PostgreSQL aborts one of them.
        b_failed: OperationalError | None = None
        try:
            b_sent = emit_signal(b, first, "go", "b")
        except OperationalError as exc:
            b_failed = exc
        if b_failed is not None:
            assert sqlstate(b_failed) == DEADLOCK
            b.rollback()
            winner, loser = "a", sending((second, first), "go", "b")
            assert a.result() == ["a", "a"]
        else:
            assert b_sent == "b"
            b.commit()
            with pytest.raises(OperationalError) as aborted:
                a.result()
            assert sqlstate(aborted.value) == DEADLOCK
            winner, loser = "b", sending((first, second), "go", "a")
    # The aborted transaction wrote nothing; sent again, it returns what the other committed.
    assert signals_of(pgtask_engine, first) == signals_of(pgtask_engine, second) == {"go": winner}
    with pgtask_engine.begin() as again:
        assert loser(again) == [winner, winner]


def test_the_same_signals_sent_in_one_order_wait_and_return_the_first_values(
    pgtask_engine: Engine,
) -> None:
    first, second = two_tasks(pgtask_engine)
    with pgtask_engine.connect() as observer, pgtask_engine.connect() as a:
        assert sending((first, second), "go", "a")(a) == ["a", "a"]
        b = Blocked(pgtask_engine, observer, sending((first, second), "go", "b"))
        a.commit()
        assert b.result() == ["a", "a"]
    assert signals_of(pgtask_engine, first) == {"go": "a"}


async def test_different_signals_in_opposite_orders_never_wait_even_when_they_wake(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    first = await add(pgtask_async_engine, "approve", "from-a")
    second = await add(pgtask_async_engine, "approve", "from-b")
    async with running_worker(waiting_registry(), pgtask_database_url, OPTIONS):
        for task_id in (first, second):
            await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
    # One thread interleaves both transactions: any lock wait would fail at lock_timeout.
    with pgtask_engine.connect() as a, pgtask_engine.connect() as b:
        for conn in (a, b):
            conn.execute(text("SET lock_timeout = '5s'"))
        assert emit_signal(a, first, "from-a", 1) == 1  # wakes `first`
        assert emit_signal(b, second, "from-b", 2) == 2  # wakes `second`
        assert emit_signal(a, second, "from-a", 1) == 1
        assert emit_signal(b, first, "from-b", 2) == 2
        a.commit()
        b.commit()
    for task_id in (first, second):
        assert (await task_row(pgtask_async_engine, task_id))["state"] == "pending"
    assert signals_of(pgtask_engine, first) == {"from-a": 1, "from-b": 2}
