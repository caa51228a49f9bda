"""Idempotent enqueues in the transaction shapes applications use besides a plain one.

A task and its key's reservation must exist together or not at all, whatever the caller's
transaction looks like: a savepoint rolled back takes both with it, and an autocommit
connection, where every statement commits on its own, must never keep a reservation whose
task was not written (a key reserved for a task that never existed would never expire, and
every later enqueue of the key would report ``created=False`` with that id).
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import IdempotencyKey, Queue, QueueFull, Task, enqueue


def _finish(session: Session, task_id: uuid.UUID, state: str = "succeeded") -> None:
    session.execute(
        update(Task).where(Task.id == task_id)
        .values(state=state, completed_at=func.statement_timestamp())
    )


def test_a_rolled_back_savepoint_takes_its_task_and_its_reservation_with_it(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        kept = enqueue(session, "t", idempotency_key="kept").id
        with session.begin_nested() as savepoint:
            enqueue(session, "t", idempotency_key="undone")
            savepoint.rollback()
        again = enqueue(session, "t", idempotency_key="undone")
        session.commit()
        assert again.created
        assert sorted(session.scalars(select(Task.id))) == sorted([kept, again.id])
        reserved = session.execute(select(IdempotencyKey.key, IdempotencyKey.task_id)).all()
    assert sorted(reserved) == [("kept", kept), ("undone", again.id)]


def test_an_expired_key_whose_take_over_fails_on_an_autocommit_connection_stays_free(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="q", idempotency_retention_seconds=0, max_outstanding_tasks=1))
        session.commit()
        old = enqueue(session, "t", queue="q", idempotency_key="k").id
        session.commit()
        _finish(session, old, "failed")  # the key has expired
        other = enqueue(session, "other", queue="q").id  # and the queue is full
        session.commit()
    autocommit = pgtask_engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    with autocommit as connection, pytest.raises(QueueFull):
        enqueue(connection, "t", queue="q", idempotency_key="k")
    with Session(pgtask_engine) as session:
        _finish(session, other)  # room again
        session.commit()
        again = enqueue(session, "t", queue="q", idempotency_key="k")
        session.commit()
        # Before: the failed take-over had committed the key for a task that was never
        # written, so this returned that id with created=False, and no task exists.
        assert again.created
        assert session.get(Task, again.id) is not None
