"""A schedule whose insert another transaction holds back (a capped queue's row locked by an
open transaction, past ``lock_timeout``) never stops the others: it is set aside for a later
pass with its reason in ``last_error``, its cursor kept; the worker rests it, longer each time
it is still held, so the waits its tries cost stay bounded. Database time is moved, never slept.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta, timezone

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import configure_queue
from sqlalchemy_pgtask.schedule import get_schedule, materialize_schedules
from sqlalchemy_pgtask.testing import DatabaseClock, wait_until
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._schedule import Schedules
from tests.integration.test_schedule import T0, cursor, make, minute, occurrences, set_now
from tests.support.waiting import PATIENCE

UTC = timezone.utc


@pytest.fixture
def capped(pgtask_engine: Engine, pgtask_clock: DatabaseClock) -> Iterator[Session]:
    """Two due schedules at 10:01:30: "held" (10:01, first in the batch) on a capped queue
    whose row an open transaction holds, and "free" (10:01:15) on the default queue."""
    set_now(pgtask_clock, T0)
    with Session(pgtask_engine) as session:
        configure_queue(session, "capped", max_outstanding_tasks=10)
        session.commit()
    make(pgtask_engine, "held", queue="capped")
    make(pgtask_engine, "free", every=60, start_at=T0 + timedelta(seconds=45))
    pgtask_clock.advance(60)
    holder = Session(pgtask_engine)
    configure_queue(holder, "capped", max_outstanding_tasks=11)  # row locked until the end
    holder.flush()
    try:
        yield holder
    finally:
        holder.rollback()
        holder.close()


def test_a_schedule_held_back_by_another_transaction_never_stops_the_others(
    pgtask_engine: Engine, capped: Session
) -> None:
    with pgtask_engine.begin() as connection:
        connection.execute(text("SET LOCAL lock_timeout = '200ms'"))
        report = materialize_schedules(connection)
    assert report.held == ["held"]
    assert report.created == 1
    assert occurrences(pgtask_engine, "free") == [T0 + timedelta(seconds=45)]
    assert occurrences(pgtask_engine, "held") == []
    assert cursor(pgtask_engine, "held") == minute(10, 1)
    with Session(pgtask_engine) as session:
        info = get_schedule(session, "held")
    assert info is not None
    assert (info.last_error or "").startswith("held back: ")
    capped.rollback()  # the transaction ends: the next pass creates its occurrence
    assert materialize_schedules(pgtask_engine).created == 1
    assert occurrences(pgtask_engine, "held") == [minute(10, 1)]
    with Session(pgtask_engine) as session:
        done = get_schedule(session, "held")
    assert done is not None
    assert done.last_error is None


async def test_the_worker_rests_a_held_schedule_instead_of_waiting_for_it_on_every_pass(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, capped: Session,
    caplog: pytest.LogCaptureFixture,
) -> None:
    connection = HeldConnection(
        pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT"),
        lock_timeout=0.2, statement_timeout=30.0,
    )
    service = Schedules(interval=5.0, batch_size=10)

    def held_back() -> int:
        return sum("'held' held back" in r.getMessage() for r in caplog.records)

    try:
        async with connection.use() as c:
            first = await service.run_once(c)
            assert occurrences(pgtask_engine, "free") == [T0 + timedelta(seconds=45)]
            assert held_back() == 1
            assert first is not None
            assert 0 < first <= 1.0  # tried again after its rest, not at the interval
            again = await service.run_once(c)  # resting: not tried, no wait for the lock
            assert held_back() == 1
            assert again is not None
            assert 0 < again <= 1.0
        capped.rollback()

        async def created() -> bool:
            async with connection.use() as c:
                await service.run_once(c)
            return occurrences(pgtask_engine, "held") == [minute(10, 1)]

        await wait_until(created, PATIENCE, message="the held schedule's occurrence")
    finally:
        await connection.close()
