"""Instant rescue at its edges: the database clock moved, workers already rescued, and
workers whose sessions the server ended (alive, perhaps, and refused new connections).

The rules of `worker._maintenance.Rescue` are checked one pass at a time with the plain
connections of `tests.integration.test_rescue.FakeWorker` standing in for a worker's.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sqlalchemy_pgtask.statements.rescue import WORKER_LOCKS, WORKER_LOCKS_WITHOUT_ENDINGS
from sqlalchemy_pgtask.testing import DatabaseClock
from sqlalchemy_pgtask.worker._maintenance import Rescue
from tests.integration.test_rescue import FakeWorker, state_of


@pytest.fixture
async def rescuer(pgtask_async_engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    auto = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as conn:
        yield conn


async def watched(
    engine: Engine, rescuer: AsyncConnection, key: int, connections: int = 1
) -> tuple[Rescue, FakeWorker, uuid.UUID]:
    """A rescue service that has seen a worker (``connections`` of its own) run a task."""
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(engine, key)
    for _ in range(connections):
        worker.connect()
    task_id = worker.running_task()
    await service.run_once(rescuer)
    return service, worker, task_id


async def test_a_clock_moved_back_does_not_make_a_worker_never_seen_alive_look_registered_since(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock, rescuer: AsyncConnection
) -> None:
    # The worker registered while the database clock ran an hour ahead; the clock was then
    # set back (or: a failover to a server whose clock is behind). The rescuer's session
    # starts after the worker's lock is gone, as after a restart: it never knew the worker
    # alive, so the lease decides, whatever the registration time says.
    pgtask_clock.set_offset(3600)
    worker = FakeWorker(pgtask_engine, 4243)
    worker.connect()
    task_id = worker.running_task()
    worker.die()
    pgtask_clock.reset()
    service = Rescue(interval=0.5, batch_size=100)
    for _ in range(3):
        await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)


async def test_a_clock_moved_forward_does_not_hide_a_worker_registered_since(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock, rescuer: AsyncConnection
) -> None:
    # The rescuer looked first, while the clock ran an hour ahead; the clock was set back,
    # then a worker registered (holding its lock) and died before the next pass. It was
    # alive during the rescuer's session: rescued at once, not left to its lease.
    pgtask_clock.set_offset(3600)
    service = Rescue(interval=0.5, batch_size=100)
    await service.run_once(rescuer)
    pgtask_clock.reset()
    worker = FakeWorker(pgtask_engine, 4244)
    worker.connect()
    task_id = worker.running_task()
    worker.die()
    await service.run_once(rescuer)
    await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("pending", 1, None)


async def test_a_rescued_worker_is_not_looked_for_again_on_every_pass(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    # Once a dead worker's tasks are taken back, nothing of it is left to rescue: the pass
    # goes back to its interval instead of running at twice its rate (and the rescue
    # statement on every pass) until the worker's row is pruned an hour later.
    service, worker, task_id = await watched(pgtask_engine, rescuer, 4245)
    worker.die()
    assert await service.run_once(rescuer) == 0.25  # missing once: look again soon
    await service.run_once(rescuer)  # missing twice: rescued
    assert state_of(pgtask_engine, task_id) == ("pending", 1, None)
    for _ in range(3):
        assert await service.run_once(rescuer) is None


async def test_a_worker_whose_sessions_the_server_ended_is_left_to_its_lease(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    # Every session terminated by the server, and none back for many passes (as while the
    # server refuses new connections): the worker may well be alive, its handler running.
    service, worker, task_id = await watched(pgtask_engine, rescuer, 4246, connections=2)
    worker.lose_sessions()
    for _ in range(6):
        await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)
    # Back, and seen alive again: a process that goes away now is rescued as usual.
    worker.connect()
    await service.run_once(rescuer)
    worker.die()
    assert await service.run_once(rescuer) == 0.25
    await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("pending", 1, None)


async def test_a_session_the_server_ended_elsewhere_in_the_database_delays_a_rescue_to_the_lease(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    # PostgreSQL counts sessions by how they ended per database, not per worker: one the
    # server ended at the same moment as a worker went away leaves that worker to its lease
    # (later, never wrong), and the worker is not looked for again on every pass.
    bystander = FakeWorker(pgtask_engine, 4248)
    bystander.connect()
    service, worker, task_id = await watched(pgtask_engine, rescuer, 4247)
    worker.die()
    bystander.lose_sessions()
    await service.run_once(rescuer)
    assert await service.run_once(rescuer) is None
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)


async def test_the_look_for_postgresql_13_reads_the_locks_without_the_count_of_ended_sessions(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    # PostgreSQL 13 has no count of how sessions ended: ``ended`` is NULL, and the verdict
    # is the two-pass rule alone.
    worker = FakeWorker(pgtask_engine, 4249)
    worker.connect()
    state = (await rescuer.execute(WORKER_LOCKS_WITHOUT_ENDINGS)).one()
    assert state.ended is None
    assert worker.id in state.holding
    counted = (await rescuer.execute(WORKER_LOCKS)).one()
    assert isinstance(counted.ended, int)
    worker.die()
