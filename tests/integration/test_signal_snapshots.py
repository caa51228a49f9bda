"""`emit_signal` in a transaction whose snapshot is older than the task: a retryable
serialization failure (SQLSTATE 40001), never `TaskNotFound` for a task that exists.

Real PostgreSQL, two connections: one holds a REPEATABLE READ or SERIALIZABLE snapshot taken
before another commits the task.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from sqlalchemy_pgtask import (
    Signal,
    TaskNotFound,
    TaskNotVisible,
    emit_signal,
    emit_signal_async,
    enqueue,
)

LEVELS = ["REPEATABLE READ", "SERIALIZABLE"]


def _enqueued(engine: Engine) -> uuid.UUID:
    with engine.begin() as conn:
        return enqueue(conn, "job").id


@pytest.fixture(params=LEVELS)
def old_snapshot(request: pytest.FixtureRequest, pgtask_engine: Engine) -> Iterator[Connection]:
    """A transaction at REPEATABLE READ or SERIALIZABLE whose snapshot is already taken."""
    with pgtask_engine.execution_options(isolation_level=request.param).connect() as conn:
        conn.execute(text("SELECT 1"))  # the snapshot is taken by the first statement
        yield conn


def test_a_signal_to_a_task_newer_than_the_snapshot_is_a_serialization_failure(
    pgtask_engine: Engine, old_snapshot: Connection
) -> None:
    task_id = _enqueued(pgtask_engine)
    with pytest.raises(TaskNotVisible) as raised:
        emit_signal(old_snapshot, task_id, "go", {"n": 1})
    assert raised.value.sqlstate == "40001"
    assert str(task_id) in str(raised.value)
    old_snapshot.rollback()
    # Retried with a new snapshot, as for any serialization failure, it is stored.
    with old_snapshot.begin():
        assert emit_signal(old_snapshot, task_id, "go", {"n": 1}) == {"n": 1}
    with Session(pgtask_engine) as session:
        stored = session.get(Signal, (task_id, "go", 0))
        assert stored is not None
        assert stored.value == {"n": 1}


def test_a_signal_to_a_task_that_does_not_exist_is_still_task_not_found(
    old_snapshot: Connection,
) -> None:
    mine = enqueue(old_snapshot, "job").id
    with pytest.raises(TaskNotFound):
        emit_signal(old_snapshot, uuid.uuid4(), "go")
    # Nothing failed in the database: the transaction goes on with what it wrote.
    assert emit_signal(old_snapshot, mine, "go", 1) == 1


def test_an_engine_that_shares_one_connection_is_never_asked_and_keeps_its_transaction(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    # Checking a StaticPool's connection out again gives the caller's own connection back,
    # and returning it rolls the caller's transaction back: it cannot tell, so not found.
    shared = create_engine(pgtask_database_url, poolclass=StaticPool)
    try:
        with shared.execution_options(isolation_level="REPEATABLE READ").connect() as conn:
            mine = enqueue(conn, "job").id
            newer = _enqueued(pgtask_engine)
            with pytest.raises(TaskNotFound):
                emit_signal(conn, newer, "go")
            assert emit_signal(conn, mine, "go", 1) == 1
            conn.commit()
    finally:
        shared.dispose()
    with Session(pgtask_engine) as session:
        assert session.get(Signal, (mine, "go", 0)) is not None


@pytest.mark.parametrize("level", LEVELS)
async def test_an_async_signal_to_a_task_newer_than_the_snapshot_is_a_serialization_failure(
    level: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.execution_options(isolation_level=level).connect() as conn:
        await conn.execute(text("SELECT 1"))
        task_id = _enqueued(pgtask_engine)
        with pytest.raises(TaskNotVisible):
            await emit_signal_async(conn, task_id, "go")
        await conn.rollback()
        with pytest.raises(TaskNotFound):
            await emit_signal_async(conn, uuid.uuid4(), "go")
