"""A due wait timeout whose rows another transaction holds never stops the other timeouts.

The held row is a real row lock from another connection: an open transaction that called
``cancel()`` on a grandchild of a timed-out child (or holds it ``FOR UPDATE``). The timeout
pass skips that wait (reported held) and times out the others; the worker's pass sets it aside
with a log line naming its task and tries it again after a rest, not on every pass. Database
time is moved, never slept.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import cancel, explain
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.testing import DatabaseClock, wait_until
from sqlalchemy_pgtask.worker._maintenance import MaintenanceRunner, WaitTimeouts
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._set_aside import REST_FIRST, REST_MAX
from tests.support import durable as d
from tests.support.clocks import StoppedClock
from tests.support.waiting import PATIENCE


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


@dataclass(frozen=True)
class Held:
    """``parent`` waits (60 s) for ``child``, whose child ``grandchild`` an open transaction
    holds; ``unrelated`` waits (2 s) for a signal. Both timeouts are due, the parent's first."""

    parent: uuid.UUID
    child: uuid.UUID
    grandchild: uuid.UUID
    unrelated: uuid.UUID


def _family(conn: Connection, clock: DatabaseClock) -> Held:
    parent = _running(conn, "parent")
    child_id = d.spawn_child(conn, parent, "ship", "child")
    d.waiting_on_child(conn, parent, "await-ship", child_id, timeout=60.0)
    child = d.claim_one(conn, "child")
    grandchild = d.spawn_child(conn, child, "label", "grandchild")
    d.waiting_on_signal(conn, child, "approval", "go")
    clock.advance(59)
    unrelated = _running(conn, "unrelated")
    d.waiting_on_signal(conn, unrelated, "approval", "go", timeout=2.0)
    clock.advance(3)
    return Held(parent.task_id, child_id, grandchild, unrelated.task_id)


def _running(conn: Connection, name: str) -> d.Lease:
    d.add_task(conn, name)
    return d.claim_one(conn, name)


@pytest.fixture(params=["cancel", "for update"])
def held(
    request: pytest.FixtureRequest, pgtask_engine: Engine, auto: Connection,
    pgtask_clock: DatabaseClock,
) -> Iterator[tuple[Held, Connection]]:
    family = _family(auto, pgtask_clock)
    with pgtask_engine.connect() as holder:
        if request.param == "cancel":
            assert cancel(holder, family.grandchild) == "cancelled"
        else:
            holder.execute(
                text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE"),
                {"id": family.grandchild},
            )
        yield family, holder
        holder.rollback()


def test_a_wait_whose_subtree_is_held_is_skipped_and_the_others_time_out(
    auto: Connection, held: tuple[Held, Connection]
) -> None:
    family, holder = held
    auto.execute(text("SET lock_timeout = '200ms'"))
    rows = auto.execute(st.WAIT_TIMEOUTS, {"limit": 10}).all()
    assert sorted((row.id, row.held) for row in rows) == sorted(
        [(family.unrelated, False), (family.parent, True)]
    )
    assert d.task_of(auto, family.unrelated)["state"] == "pending"
    assert d.checkpoints_of(auto, family.unrelated)["approval", 0] == ("signal", {"timeout": True})
    # The held wait is untouched: nothing of its family changed.
    assert d.task_of(auto, family.parent)["state"] == "waiting"
    assert d.task_of(auto, family.child)["state"] == "waiting"
    assert d.wait_of(auto, family.parent) is not None
    (reason,) = explain(auto, family.parent).reasons
    assert reason.code == "waiting_child"
    assert "timed out at" in reason.message
    assert "not yet applied (a transaction may hold" in reason.message
    holder.rollback()  # the transaction ends: the next pass times the wait out
    assert d.wait_timeouts(auto) == [family.parent]
    assert d.task_of(auto, family.child)["state"] == "cancelled"
    assert d.task_of(auto, family.grandchild)["state"] == "cancelled"


async def test_the_worker_sets_a_held_wait_aside_and_times_out_the_others(
    auto: Connection, pgtask_async_engine: AsyncEngine, held: tuple[Held, Connection],
    caplog: pytest.LogCaptureFixture,
) -> None:
    family, holder = held
    connection = HeldConnection(
        pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT"),
        lock_timeout=0.2, statement_timeout=30.0,
    )
    clock = StoppedClock()
    service = WaitTimeouts(interval=5.0, batch_size=10, clock=clock)

    def held_back() -> int:
        return sum(
            f"wait timeout of task {family.parent} held back" in r.getMessage()
            for r in caplog.records
        )

    try:
        async with connection.use() as c:
            first = await service.run_once(c)
            assert d.task_of(auto, family.unrelated)["state"] == "pending"
            assert held_back() == 1
            assert first == REST_FIRST  # tried again after its rest, not at the interval
            again = await service.run_once(c)  # resting: left out, not tried again
            assert held_back() == 1
            assert again == REST_FIRST
        assert d.task_of(auto, family.parent)["state"] == "waiting"
        holder.rollback()
        clock.now += REST_MAX  # its rest is over

        async def timed_out() -> bool:
            async with connection.use() as c:
                await service.run_once(c)
            return bool(d.task_of(auto, family.parent)["state"] == "pending")

        await wait_until(timed_out, PATIENCE, message="the set-aside wait timed out")
        assert d.task_of(auto, family.grandchild)["state"] == "cancelled"
    finally:
        await connection.close()


async def test_after_a_batch_cut_short_the_waits_are_timed_out_one_at_a_time(
    pgtask_engine: Engine, auto: Connection, pgtask_async_engine: AsyncEngine,
    pgtask_clock: DatabaseClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock the statement cannot skip (another transaction inserting the very checkpoint
    the timeout would store) cuts the whole batch short: the due waits are then tried one at a
    time, the held one set aside, the other timed out."""
    family = _family(auto, pgtask_clock)
    connection = HeldConnection(
        pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT"),
        lock_timeout=0.2, statement_timeout=30.0,
    )
    service = WaitTimeouts(interval=5.0, batch_size=10)
    with pgtask_engine.connect() as holder:
        holder.execute(
            text(
                "INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)"
                " VALUES (:id, :version, 'await-ship', 0, 'result', '{}'::jsonb)"
            ),
            {"id": family.parent, "version": d.VERSION},
        )
        try:
            async with connection.use() as c:
                await service.run_once(c)
            assert d.task_of(auto, family.unrelated)["state"] == "pending"
            assert d.task_of(auto, family.parent)["state"] == "waiting"
            assert any(
                f"wait timeout of task {family.parent} held back (lock_not_available)"
                in r.getMessage() for r in caplog.records
            )
        finally:
            holder.rollback()
            await connection.close()


async def test_a_wait_past_statement_timeout_is_set_aside_within_the_passs_deadline(
    pgtask_engine: Engine, auto: Connection, pgtask_async_engine: AsyncEngine,
    pgtask_clock: DatabaseClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock wait that ends on ``statement_timeout`` (``lock_timeout`` is longer) costs the
    batch one timeout and the held wait alone another: together longer than the maintenance
    connection's deadline. Each statement of the runner's pass gets the whole deadline, so the
    held wait is set aside and the other times out; before, the deadline severed the pass
    before it set anything aside, and every pass did the same."""
    family = _family(auto, pgtask_clock)
    connection = HeldConnection(
        pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT"),
        lock_timeout=30.0, statement_timeout=1.0, deadline=1.6,
    )
    runner = MaintenanceRunner(connection, [WaitTimeouts(interval=60.0, batch_size=10)])
    with pgtask_engine.connect() as holder:
        holder.execute(
            text(
                "INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)"
                " VALUES (:id, :version, 'await-ship', 0, 'result', '{}'::jsonb)"
            ),
            {"id": family.parent, "version": d.VERSION},
        )
        running = asyncio.create_task(runner.run())
        try:
            await wait_until(
                lambda: d.task_of(auto, family.unrelated)["state"] == "pending", PATIENCE,
                message="the unrelated wait timed out",
            )
            await wait_until(
                lambda: any(
                    f"wait timeout of task {family.parent} held back (statement_timeout)"
                    in r.getMessage() for r in caplog.records
                ),
                PATIENCE, message="the slow wait set aside",
            )
            assert d.task_of(auto, family.parent)["state"] == "waiting"
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            holder.rollback()
            await connection.close()
