"""Instant rescue: the running tasks of a worker whose connections are all gone are taken
back at once, not at lease expiry (`worker._maintenance.Rescue`, `statements.rescue`).

A worker's connections each hold the advisory lock ``(LOCK_NAMESPACE, lock_key)`` in shared
mode. Here plain connections stand in for a worker's, and the service's passes are run one at
a time, so each rule is checked by itself: a worker is gone only when the rescuer saw it
holding its lock on the same backend of its own and then saw the lock missing on two passes
in a row; one live connection keeps it alive; a rescuer whose own session was replaced (a
server restart, a failover) starts afresh and rescues nobody it has not seen alive since.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sqlalchemy_pgtask import (
    Attempt,
    Registry,
    Task,
    TaskContext,
    WorkerOptions,
    enqueue,
    statements,
)
from sqlalchemy_pgtask.statements.rescue import LOCK_NAMESPACE, RESCUE
from sqlalchemy_pgtask.testing import running_worker, wait_until
from sqlalchemy_pgtask.worker._maintenance import Rescue
from tests.support.tasks import claim_parameters
from tests.support.waiting import PATIENCE

LEASE = 3600.0


class FakeWorker:
    """A registered worker whose lock is held by the connections it opens."""

    def __init__(self, engine: Engine, key: int | None) -> None:
        self.id, self.key, self._engine = uuid.uuid4(), key, engine
        self.connections: list[Connection] = []
        with engine.begin() as conn:
            conn.execute(statements.REGISTER_WORKER, {
                "worker_id": self.id, "queues": ["default"], "version": "test",
                "hostname": "test", "pid": 1, "concurrency": 1, "ttl_seconds": 30.0,
                "lock_key": key,
            })

    def connect(self) -> Connection:
        conn = self._engine.connect()
        conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(select(func.pg_advisory_lock_shared(LOCK_NAMESPACE, self.key)))
        self.connections.append(conn)
        return conn

    def drop(self, conn: Connection) -> None:
        """Close the session for good (back in the pool, it would keep its locks)."""
        conn.invalidate()
        conn.close()
        self.connections.remove(conn)

    def die(self) -> None:
        for conn in list(self.connections):
            self.drop(conn)
        self._wait_for_the_lock_to_go()

    def lose_sessions(self) -> None:
        """The server ends every session of this worker (``pg_terminate_backend``), as it
        does to a live worker it then refuses new connections for a while."""
        pids = [conn.execute(select(func.pg_backend_pid())).scalar_one()
                for conn in self.connections]
        with self._engine.connect() as conn:
            for pid in pids:
                conn.execute(select(func.pg_terminate_backend(pid)))
        for conn in list(self.connections):
            self.drop(conn)
        self._wait_for_the_lock_to_go()

    def _wait_for_the_lock_to_go(self) -> None:
        # A closed session's backend ends (and drops its locks) a moment later.
        with self._engine.connect() as conn:
            for _ in range(500):
                held = conn.execute(
                    select(func.count()).select_from(text("pg_locks")).where(
                        text("locktype = 'advisory' AND classid = :ns AND objid = :key"
                             " AND database = (SELECT oid FROM pg_database"
                             " WHERE datname = current_database())")
                    ),
                    {"ns": LOCK_NAMESPACE, "key": self.key or 0},
                ).scalar_one()
                if not held:
                    return
                conn.rollback()
                time.sleep(0.01)
        raise AssertionError("the dropped sessions kept the lock")

    def running_task(self) -> uuid.UUID:
        with self._engine.begin() as conn:
            task_id = enqueue(conn, "job", max_attempts=3).id
        with self._engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            [row] = conn.execute(
                statements.CLAIM, claim_parameters(worker_id=self.id, lease=LEASE)
            ).all()
        assert row.id == task_id
        return task_id


@pytest.fixture
async def rescuer(pgtask_async_engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    auto = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as conn:
        yield conn


def state_of(engine: Engine, task_id: uuid.UUID) -> tuple[object, ...]:
    with engine.connect() as conn:
        task = conn.execute(
            select(Task.state, Task.failed_attempts, Task.lease_owner).where(Task.id == task_id)
        ).one()
    return tuple(task)


async def test_a_killed_worker_is_rescued_after_two_passes_without_its_lock(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(pgtask_engine, 4242)
    worker.connect()
    worker.connect()
    task_id = worker.running_task()
    await service.run_once(rescuer)  # seen holding its lock
    worker.die()
    await service.run_once(rescuer)  # missing once: not yet
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)
    await service.run_once(rescuer)  # missing twice: gone
    assert state_of(pgtask_engine, task_id) == ("pending", 1, None)
    with pgtask_engine.connect() as conn:
        attempt = conn.execute(select(Attempt.state, Attempt.error)).one()
    assert tuple(attempt) == ("lost", {"type": "lease_expired", "reason": "worker_gone"})


async def test_a_worker_registered_since_the_first_pass_needs_no_sighting(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    # It took its lock before it registered: registered while this rescuer looked on, it
    # held the lock in this rescuer's session even if it died before the next pass.
    service = Rescue(interval=0.5, batch_size=100)
    await service.run_once(rescuer)
    worker = FakeWorker(pgtask_engine, 11)
    worker.connect()
    task_id = worker.running_task()
    worker.die()
    await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)
    await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("pending", 1, None)


async def test_one_live_connection_keeps_a_worker_alive(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(pgtask_engine, 5)
    first = worker.connect()
    worker.connect()
    task_id = worker.running_task()
    await service.run_once(rescuer)
    worker.drop(first)
    for _ in range(3):
        await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)
    worker.die()


async def test_a_worker_back_before_the_second_pass_keeps_its_tasks(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(pgtask_engine, 6)
    worker.connect()
    task_id = worker.running_task()
    await service.run_once(rescuer)
    worker.die()  # a network blip: every connection dropped...
    await service.run_once(rescuer)
    worker.connect()  # ...and it reconnected
    for _ in range(3):
        await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)
    worker.die()


async def test_a_worker_never_seen_alive_is_left_to_its_lease(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(pgtask_engine, 7)
    worker.connect()
    task_id = worker.running_task()
    worker.die()  # gone before this rescuer ever looked
    for _ in range(3):
        await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)


async def test_a_rescuer_whose_session_was_replaced_starts_afresh(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, rescuer: AsyncConnection
) -> None:
    # As after a server restart or a failover: the rescuer's own backend is new, and every
    # worker's lock is gone until it reconnects. What it saw before proves nothing now.
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(pgtask_engine, 8)
    worker.connect()
    task_id = worker.running_task()
    await service.run_once(rescuer)
    worker.die()
    await service.run_once(rescuer)
    auto = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as fresh:  # another backend than the rescuer's so far
        for _ in range(3):
            await service.run_once(fresh)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)


async def test_a_worker_without_a_lock_is_left_to_its_lease(
    pgtask_engine: Engine, rescuer: AsyncConnection
) -> None:
    service = Rescue(interval=0.5, batch_size=100)
    worker = FakeWorker(pgtask_engine, None)  # instant_rescue=False
    task_id = worker.running_task()
    for _ in range(3):
        await service.run_once(rescuer)
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)


async def test_another_databases_lock_does_not_keep_a_worker_alive(
    pgtask_engine: Engine, empty_engine: Engine, rescuer: AsyncConnection
) -> None:
    service = Rescue(interval=0.5, batch_size=100)
    other = empty_engine.connect()  # the same key, in another database of the cluster
    other.execute(select(func.pg_advisory_lock_shared(LOCK_NAMESPACE, 5150)))
    try:
        worker = FakeWorker(pgtask_engine, 5150)
        worker.connect()
        task_id = worker.running_task()
        await service.run_once(rescuer)
        worker.die()
        await service.run_once(rescuer)
        await service.run_once(rescuer)
        assert state_of(pgtask_engine, task_id) == ("pending", 1, None)
    finally:
        other.invalidate()
        other.close()


async def test_a_peer_killed_as_soon_as_a_worker_is_ready_is_rescued(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    # The peer registered before the worker started and dies the moment the worker is ready:
    # the worker looked at its peers before registering, so it saw this one alive.
    peer = FakeWorker(pgtask_engine, 31337)
    peer.connect()
    task_id = peer.running_task()
    registry = Registry()

    @registry.task("other")  # never "job": the rescued task stays pending for the assertion
    async def other(ctx: TaskContext, payload: object) -> None:
        return None

    options = WorkerOptions(lease_duration=LEASE, rescue_interval=0.2)
    async with running_worker(registry, pgtask_database_url, options):
        peer.die()  # blocks the worker's loop: its regular passes all come after this
        await wait_until(lambda: state_of(pgtask_engine, task_id)[0] == "pending", PATIENCE,
                         message="the worker to rescue its dead peer's task")
    assert state_of(pgtask_engine, task_id) == ("pending", 1, None)


def test_the_rescue_statement_checks_the_lock_again(pgtask_engine: Engine) -> None:
    worker = FakeWorker(pgtask_engine, 9)
    worker.connect()  # back by the time the statement runs
    task_id = worker.running_task()
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert conn.execute(RESCUE, {"owners": [worker.id], "limit": 10}).all() == []
    assert state_of(pgtask_engine, task_id) == ("running", 0, worker.id)
    worker.die()
