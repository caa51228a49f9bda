"""One task whose recovery another transaction holds back never stops the recovery or rescue of
the others (`worker._maintenance.Recovery`, `Rescue`).

The held row is a real row lock from another connection: an open transaction holding ``FOR
UPDATE`` the pending child of a running task whose cancellation was requested. Recovering that
task cancels it, and the cascade must lock the child: the whole batch used to fail on
``lock_timeout``, every pass, so no expired lease (or gone worker's task) was taken back while
the transaction lasted. Now the batch falls back to one task at a time, the held one is set
aside with a log line naming it, and the others are taken back. Database time is moved, never
slept.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import cancel
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.testing import wait_until
from sqlalchemy_pgtask.worker._maintenance import MaintenanceService, Recovery, Rescue
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._set_aside import REST_FIRST, REST_MAX
from tests.integration.test_rescue import FakeWorker
from tests.support import durable as d
from tests.support.clocks import StoppedClock
from tests.support.trees import add_chain
from tests.support.waiting import PATIENCE


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


@pytest.fixture
async def maintenance(pgtask_async_engine: AsyncEngine) -> AsyncIterator[HeldConnection]:
    connection = HeldConnection(
        pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT"),
        lock_timeout=0.2, statement_timeout=30.0,
    )
    try:
        yield connection
    finally:
        await connection.close()


def _hold_child(engine: Engine, auto: Connection, stuck: uuid.UUID) -> tuple[uuid.UUID, Connection]:
    """A pending child below ``stuck`` (whose cancellation is then requested), held ``FOR
    UPDATE`` by an open transaction."""
    [child] = add_chain(auto, stuck, 1)
    assert cancel(auto, stuck) == "running"
    holder = engine.connect()
    holder.execute(text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE"), {"id": child})
    return child, holder


async def _pass(connection: HeldConnection, service: MaintenanceService) -> float | None:
    async with connection.use() as c:
        return await service.run_once(c)


def _held_back(caplog: pytest.LogCaptureFixture, what: str, task: uuid.UUID) -> int:
    return sum(f"{what} of task {task} held back" in r.getMessage() for r in caplog.records)


async def test_a_held_expired_lease_never_stops_the_recovery_of_the_others(
    pgtask_engine: Engine, auto: Connection, maintenance: HeldConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d.add_task(auto, "job")
    d.add_task(auto, "job")
    stuck, unrelated = (lease.task_id for lease in d.claim(auto, "job"))
    child, holder = _hold_child(pgtask_engine, auto, stuck)
    try:
        d.expire_lease(auto, stuck)
        d.expire_lease(auto, unrelated)
        clock = StoppedClock()
        service = Recovery(interval=5.0, batch_size=10, clock=clock)
        first = await _pass(maintenance, service)
        assert d.task_of(auto, unrelated)["state"] == "pending"
        assert d.task_of(auto, stuck)["state"] == "running"
        assert _held_back(caplog, "recovery", stuck) == 1
        assert first == REST_FIRST  # tried again after its rest, not at the interval
        await _pass(maintenance, service)  # resting: left out, no wait for the lock
        assert _held_back(caplog, "recovery", stuck) == 1
    finally:
        holder.rollback()
        holder.close()
    clock.now += REST_MAX  # its rest is over

    async def recovered() -> bool:
        await _pass(maintenance, service)
        return bool(d.task_of(auto, stuck)["state"] == "cancelled")

    await wait_until(recovered, PATIENCE, message="the set-aside task recovered")
    assert d.task_of(auto, child)["state"] == "cancelled"


async def test_after_its_rest_a_held_task_is_tried_alone_not_inside_the_batch(
    pgtask_engine: Engine, auto: Connection, maintenance: HeldConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Still held when its rest ends, it would fail the whole batch again (and roll back the
    recovery of the others); tried alone first, it is set aside for twice as long and the
    batch takes the others at once."""
    caplog.set_level(logging.INFO, logger="sqlalchemy_pgtask.worker")
    d.add_task(auto, "job")
    d.add_task(auto, "job")
    stuck, unrelated = (lease.task_id for lease in d.claim(auto, "job"))
    child, holder = _hold_child(pgtask_engine, auto, stuck)
    try:
        d.expire_lease(auto, stuck)
        clock = StoppedClock()
        service = Recovery(interval=5.0, batch_size=10, clock=clock)
        assert await _pass(maintenance, service) == REST_FIRST
        assert _held_back(caplog, "recovery", stuck) == 1
        d.expire_lease(auto, unrelated)
        clock.now += REST_FIRST
        caplog.clear()
        assert await _pass(maintenance, service) == 2 * REST_FIRST  # tried alone: rest doubled
        assert _held_back(caplog, "recovery", stuck) == 1
        assert d.task_of(auto, unrelated)["state"] == "pending"
        assert d.task_of(auto, stuck)["state"] == "running"
        assert not [r for r in caplog.records if "of a batch was cut short" in r.getMessage()]
    finally:
        holder.rollback()
        holder.close()
    clock.now += REST_MAX
    await _pass(maintenance, service)  # tried alone once more: recovered
    assert d.task_of(auto, stuck)["state"] == "cancelled"
    assert d.task_of(auto, child)["state"] == "cancelled"


async def test_a_held_task_of_a_gone_worker_never_stops_the_rescue_of_the_others(
    pgtask_engine: Engine, auto: Connection, maintenance: HeldConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = FakeWorker(pgtask_engine, 5151)
    worker.connect()
    stuck = worker.running_task()
    unrelated = worker.running_task()
    child, holder = _hold_child(pgtask_engine, auto, stuck)
    clock = StoppedClock()
    service = Rescue(interval=5.0, batch_size=10, clock=clock)
    try:
        await _pass(maintenance, service)  # seen holding its lock
        worker.die()
        await _pass(maintenance, service)  # missing once
        await _pass(maintenance, service)  # missing twice: gone
        assert d.task_of(auto, unrelated)["state"] == "pending"
        assert d.task_of(auto, stuck)["state"] == "running"
        assert _held_back(caplog, "rescue", stuck) == 1
        await _pass(maintenance, service)  # resting: left out
        assert _held_back(caplog, "rescue", stuck) == 1
    finally:
        holder.rollback()
        holder.close()
    clock.now += REST_MAX  # its rest is over

    async def rescued() -> bool:
        await _pass(maintenance, service)
        return bool(d.task_of(auto, stuck)["state"] == "cancelled")

    await wait_until(rescued, PATIENCE, message="the set-aside task rescued")
    assert d.task_of(auto, child)["state"] == "cancelled"


def test_the_batch_statements_leave_out_the_tasks_set_aside(auto: Connection) -> None:
    d.add_task(auto, "job")
    d.add_task(auto, "job")
    first, second = (lease.task_id for lease in d.claim(auto, "job"))
    d.expire_lease(auto, first)
    d.expire_lease(auto, second)
    rows = auto.execute(st.RECOVER, {"limit": 10, "aside": [first]}).all()
    assert [row.id for row in rows] == [second]
    assert d.task_of(auto, first)["state"] == "running"
