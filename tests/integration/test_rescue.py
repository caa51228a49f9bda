"""Instant rescue: the running tasks of a worker whose connections are all gone are taken
back at once, not at lease expiry (`statements.RESCUE`).

A worker's connections each hold the advisory lock ``(LOCK_NAMESPACE, lock_key)`` in shared
mode; its row records the key and, by heartbeat on such a connection, when the lock was last
held (``locked_at``). Here plain connections stand in for a worker's, so each condition is
checked by itself: one live holder is enough to keep the tasks; a worker that never said it
held the lock, or said so before the server started, is left to its leases.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import Connection, Engine, func, select, text

from sqlalchemy_pgtask import Attempt, Task, enqueue, statements
from sqlalchemy_pgtask.statements.rescue import LOCK_NAMESPACE, RESCUE
from tests.support.tasks import claim_parameters

LEASE = 3600.0


def register(conn: Connection, worker_id: uuid.UUID, key: int | None, locked: bool) -> None:
    conn.execute(
        statements.REGISTER_WORKER,
        {
            "worker_id": worker_id, "queues": ["default"], "version": "test",
            "hostname": "test", "pid": 1, "concurrency": 1, "ttl_seconds": 30.0,
            "lock_key": key,
        },
    )
    if locked:
        conn.execute(
            statements.HEARTBEAT, {"worker_id": worker_id, "ttl_seconds": 30.0, "draining": False}
        )


def running_task(engine: Engine, worker_id: uuid.UUID) -> uuid.UUID:
    with engine.begin() as conn:
        task_id = enqueue(conn, "job", max_attempts=3).id
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        [row] = conn.execute(
            statements.CLAIM, claim_parameters(worker_id=worker_id, lease=LEASE)
        ).all()
    assert row.id == task_id
    return task_id


def hold(engine: Engine, key: int) -> Connection:
    conn = engine.connect()
    conn.execution_options(isolation_level="AUTOCOMMIT")
    conn.execute(select(func.pg_advisory_lock_shared(LOCK_NAMESPACE, key)))
    return conn


def drop(conn: Connection) -> None:
    """Close the session for good (back in the pool, it would keep its locks)."""
    conn.invalidate()
    conn.close()


def rescue(engine: Engine) -> list[uuid.UUID]:
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        return [row.id for row in conn.execute(RESCUE, {"limit": 100})]


def test_a_worker_with_a_live_connection_keeps_its_tasks_and_loses_them_with_the_last(
    pgtask_engine: Engine,
) -> None:
    worker_id, key = uuid.uuid4(), 4242
    first, second = hold(pgtask_engine, key), hold(pgtask_engine, key)
    try:
        register(first, worker_id, key, locked=True)
        task_id = running_task(pgtask_engine, worker_id)
        assert rescue(pgtask_engine) == []
        drop(first)  # one connection dropped: the worker lives on
        assert rescue(pgtask_engine) == []
    finally:
        drop(second)
    assert rescue(pgtask_engine) == [task_id]
    with pgtask_engine.connect() as conn:
        task = conn.execute(
            select(Task.state, Task.failed_attempts, Task.lease_owner).where(Task.id == task_id)
        ).one()
        attempt = conn.execute(
            select(Attempt.state, Attempt.error).where(Attempt.task_id == task_id)
        ).one()
    # Back to pending at once, the lease far from expiry; the lost attempt counts.
    assert tuple(task) == ("pending", 1, None)
    assert tuple(attempt) == ("lost", {"type": "lease_expired", "reason": "worker_gone"})
    assert rescue(pgtask_engine) == []


def test_a_worker_that_never_confirmed_its_lock_is_left_to_its_leases(
    pgtask_engine: Engine,
) -> None:
    worker_id = uuid.uuid4()
    with pgtask_engine.begin() as conn:
        register(conn, worker_id, 77, locked=False)  # registered, no heartbeat yet
    running_task(pgtask_engine, worker_id)
    assert rescue(pgtask_engine) == []


def test_a_worker_without_a_lock_is_left_to_its_leases(pgtask_engine: Engine) -> None:
    worker_id = uuid.uuid4()
    with pgtask_engine.begin() as conn:
        register(conn, worker_id, None, locked=True)  # instant_rescue=False
    running_task(pgtask_engine, worker_id)
    assert rescue(pgtask_engine) == []


def test_locks_lost_to_a_server_restart_say_nothing_until_taken_again(
    pgtask_engine: Engine,
) -> None:
    worker_id, key = uuid.uuid4(), 99
    holder = hold(pgtask_engine, key)
    register(holder, worker_id, key, locked=True)
    task_id = running_task(pgtask_engine, worker_id)
    # As after a restart: the lock was confirmed before the server (re)started.
    holder.execute(
        text("UPDATE pgtask.workers SET locked_at = pg_postmaster_start_time() - :gap"
             " WHERE id = :id"),
        {"gap": timedelta(seconds=1), "id": worker_id},
    )
    drop(holder)
    assert rescue(pgtask_engine) == []
    holder = hold(pgtask_engine, key)  # the worker reconnects, heartbeats, then dies
    try:
        holder.execute(
            statements.HEARTBEAT, {"worker_id": worker_id, "ttl_seconds": 30.0, "draining": False}
        )
    finally:
        drop(holder)
    assert rescue(pgtask_engine) == [task_id]


def test_another_databases_lock_does_not_keep_a_worker_alive(
    pgtask_engine: Engine, empty_engine: Engine
) -> None:
    worker_id, key = uuid.uuid4(), 5150
    other = hold(empty_engine, key)  # same key, another database of the cluster
    try:
        holder = hold(pgtask_engine, key)
        register(holder, worker_id, key, locked=True)
        task_id = running_task(pgtask_engine, worker_id)
        drop(holder)
        assert rescue(pgtask_engine) == [task_id]
    finally:
        drop(other)
