"""On an AUTOCOMMIT connection an administrative change and its audit entry commit together.

Each test makes the audit INSERT fail (a trigger of this test's database raises) and shows
that the change it belonged to did not commit either. On the old code the change committed
by itself, its statement autocommitted before the audit INSERT was refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    cancel,
    cancel_async,
    configure_queue,
    configure_queue_async,
    delete_schedule,
    enqueue,
    pause_schedule,
    resume_schedule,
    set_schedule,
)
from sqlalchemy_pgtask.admin import (
    pause_queue,
    pause_queue_async,
    resume_queue,
    resume_queue_async,
    retry,
    retry_async,
)
from sqlalchemy_pgtask.models import AuditEntry, Queue, Schedule, Task

REFUSE_AUDIT = """
CREATE OR REPLACE FUNCTION public.refuse_audit() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN RAISE EXCEPTION 'audit refused by the test'; END $$;
CREATE TRIGGER refuse_audit BEFORE INSERT ON pgtask.audit_log
    FOR EACH ROW EXECUTE FUNCTION public.refuse_audit();
"""


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def refuse_audit(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text(REFUSE_AUDIT))


def allow_audit(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("DROP TRIGGER refuse_audit ON pgtask.audit_log"))


def entries(engine: Engine) -> int:
    with engine.connect() as connection:
        return len(connection.execute(select(AuditEntry.id)).all())


def task_state(engine: Engine, task_id: uuid.UUID) -> str:
    with engine.connect() as connection:
        return str(connection.execute(select(Task.state).where(Task.id == task_id)).scalar_one())


def paused(engine: Engine, name: str) -> bool | None:
    """Whether ``name`` is paused; None: the queue has no row."""
    with engine.connect() as connection:
        row = connection.execute(select(Queue.paused_at).where(Queue.name == name)).first()
    return None if row is None else row.paused_at is not None


def queue_limit(engine: Engine, name: str) -> int | None:
    with engine.connect() as connection:
        return connection.execute(
            select(Queue.max_outstanding_tasks).where(Queue.name == name)
        ).scalar_one_or_none()


def pending_task(engine: Engine) -> uuid.UUID:
    with engine.begin() as connection:
        return enqueue(connection, "job").id


def cancelled_task(engine: Engine) -> uuid.UUID:
    task_id = pending_task(engine)
    with engine.begin() as connection:
        cancel(connection, task_id)
    return task_id


def refused(engine: Engine, call: Callable[[], Any]) -> None:
    """``call`` fails on its audit entry and leaves no entry behind."""
    before = entries(engine)
    refuse_audit(engine)
    with pytest.raises(DBAPIError, match="audit refused by the test"):
        call()
    allow_audit(engine)
    assert entries(engine) == before


def test_a_cancel_whose_audit_entry_fails_does_not_commit(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = pending_task(pgtask_engine)
    refused(pgtask_engine, lambda: cancel(auto, task_id, actor="ann"))
    assert task_state(pgtask_engine, task_id) == "pending"
    # The connection is usable afterwards, and autocommits again: no transaction was left open.
    assert cancel(auto, task_id) == "cancelled"
    assert task_state(pgtask_engine, task_id) == "cancelled"
    assert not auto.execute(text("SELECT pg_current_xact_id_if_assigned()")).scalar()


def test_a_transaction_begun_by_hand_on_an_autocommit_connection_is_joined_not_committed(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = pending_task(pgtask_engine)
    auto.exec_driver_sql("BEGIN")
    assert cancel(auto, task_id) == "cancelled"
    pause_queue(auto, "emails")
    auto.exec_driver_sql("ROLLBACK")
    assert task_state(pgtask_engine, task_id) == "pending"
    assert paused(pgtask_engine, "emails") is None
    assert entries(pgtask_engine) == 0


def test_a_retry_whose_audit_entry_fails_does_not_commit(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = cancelled_task(pgtask_engine)
    refused(pgtask_engine, lambda: retry(auto, task_id))
    assert task_state(pgtask_engine, task_id) == "cancelled"
    assert retry(auto, task_id) == "cancelled"
    assert task_state(pgtask_engine, task_id) == "pending"


def test_a_pause_whose_audit_entry_fails_does_not_commit(
    pgtask_engine: Engine, auto: Connection
) -> None:
    refused(pgtask_engine, lambda: pause_queue(auto, "emails"))
    assert paused(pgtask_engine, "emails") is None  # not even the queue's row was created
    pause_queue(auto, "emails")
    assert paused(pgtask_engine, "emails") is True


def test_a_resume_whose_audit_entry_fails_does_not_commit(
    pgtask_engine: Engine, auto: Connection
) -> None:
    pause_queue(auto, "emails")
    refused(pgtask_engine, lambda: resume_queue(auto, "emails"))
    assert paused(pgtask_engine, "emails") is True


def test_a_queue_configuration_whose_audit_entry_fails_does_not_commit(
    pgtask_engine: Engine, auto: Connection
) -> None:
    configure_queue(auto, "emails", max_outstanding_tasks=5)
    refused(pgtask_engine, lambda: configure_queue(auto, "emails", max_outstanding_tasks=9))
    assert queue_limit(pgtask_engine, "emails") == 5
    refused(pgtask_engine, lambda: configure_queue(auto, "new", max_outstanding_tasks=3))
    assert queue_limit(pgtask_engine, "new") is None
    configure_queue(auto, "emails", max_outstanding_tasks=9)
    assert queue_limit(pgtask_engine, "emails") == 9


def test_schedule_changes_whose_audit_entry_fails_do_not_commit(
    pgtask_engine: Engine, auto: Connection
) -> None:
    def schedule() -> dict[str, Any] | None:
        with pgtask_engine.connect() as connection:
            row = connection.execute(
                select(Schedule.name, Schedule.paused_at).where(Schedule.name == "nightly")
            ).mappings().first()
        return None if row is None else dict(row)

    refused(pgtask_engine, lambda: set_schedule(auto, "nightly", task="job", cron="0 3 * * *"))
    assert schedule() is None
    set_schedule(auto, "nightly", task="job", cron="0 3 * * *")
    refused(pgtask_engine, lambda: pause_schedule(auto, "nightly"))
    assert schedule() == {"name": "nightly", "paused_at": None}
    pause_schedule(auto, "nightly")
    refused(pgtask_engine, lambda: resume_schedule(auto, "nightly"))
    assert schedule()["paused_at"] is not None  # type: ignore[index]
    refused(pgtask_engine, lambda: delete_schedule(auto, "nightly"))
    assert schedule() is not None


# -- the same through an AsyncConnection ----------------------------------------------------


async def refused_async(engine: Engine, call: Callable[[], Any]) -> None:
    before = entries(engine)
    refuse_audit(engine)
    with pytest.raises(DBAPIError, match="audit refused by the test"):
        await call()
    allow_audit(engine)
    assert entries(engine) == before


async def test_async_changes_whose_audit_entry_fails_do_not_commit(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    pending, cancelled = pending_task(pgtask_engine), cancelled_task(pgtask_engine)
    autocommit = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.connect() as conn:
        assert isinstance(conn, AsyncConnection)
        await refused_async(pgtask_engine, lambda: cancel_async(conn, pending))
        assert task_state(pgtask_engine, pending) == "pending"
        await refused_async(pgtask_engine, lambda: retry_async(conn, cancelled))
        assert task_state(pgtask_engine, cancelled) == "cancelled"
        await refused_async(pgtask_engine, lambda: pause_queue_async(conn, "emails"))
        assert paused(pgtask_engine, "emails") is None
        await pause_queue_async(conn, "emails")
        await refused_async(pgtask_engine, lambda: resume_queue_async(conn, "emails"))
        assert paused(pgtask_engine, "emails") is True
        await refused_async(
            pgtask_engine, lambda: configure_queue_async(conn, "emails", max_outstanding_tasks=4)
        )
        assert queue_limit(pgtask_engine, "emails") is None
        assert await cancel_async(conn, pending) == "cancelled"
        assert task_state(pgtask_engine, pending) == "cancelled"


def test_a_session_on_an_autocommit_engine_keeps_the_change_and_entry_together(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    # AUTOCOMMIT asked for by create_engine rather than an execution option, through a Session.
    engine = create_engine(pgtask_database_url, isolation_level="AUTOCOMMIT")
    task_id = pending_task(pgtask_engine)
    try:
        with Session(engine) as session:
            refused(pgtask_engine, lambda: cancel(session, task_id))
            assert task_state(pgtask_engine, task_id) == "pending"
            session.rollback()
            pause_queue(session, "emails")
            assert paused(pgtask_engine, "emails") is True  # committed by the call itself
    finally:
        engine.dispose()
