"""``run_schedule_now``: one occurrence of a schedule enqueued now from its template, in the
caller's transaction, with a ``schedule.run_now`` audit entry; the cursor stays, a rollback
leaves nothing, and a role without the producer's insert is refused with nothing written.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    InvalidNameError,
    get_schedule,
    pause_schedule,
    run_schedule_now,
    run_schedule_now_async,
    set_schedule,
)
from sqlalchemy_pgtask._defaults import SCHEDULE_HEADER
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.models import AuditEntry, Task
from sqlalchemy_pgtask.schedule import ScheduleNotFound
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support.roles import login_roles, role_engine, sqlstate_of

T0 = datetime(2030, 6, 3, 10, 0, 30, tzinfo=timezone.utc)


def _nightly(engine: Engine) -> datetime:
    """The schedule ``nightly`` (Berlin, 03:00); its cursor."""
    with engine.begin() as connection:
        info = set_schedule(
            connection, "nightly", task="report", cron="0 3 * * *", timezone="Europe/Berlin",
            queue="reports", payload={"kind": "daily"}, headers={"team": "ops"}, priority=3,
            max_attempts=4, timeout=60, overlap="skip",
        )
    return info.next_run_at


def _counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as connection:
        tasks = connection.scalar(select(func.count()).select_from(Task))
        entries = connection.scalar(select(func.count()).select_from(AuditEntry))
    return int(tasks or 0), int(entries or 0)


def test_run_now_enqueues_the_template_now_and_audits_it_without_moving_the_cursor(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    pgtask_clock.set_offset((T0 - datetime.now(timezone.utc)).total_seconds())
    cursor = _nightly(pgtask_engine)

    with Session(pgtask_engine) as session:
        before = session.execute(select(NOW)).scalar_one()
        task_id = run_schedule_now(session, "nightly", actor="ops", reason="late data")
        after = session.execute(select(NOW)).scalar_one()
        session.commit()

    with pgtask_engine.connect() as connection:
        task = connection.execute(select(Task).where(Task.id == task_id)).one()
        info = get_schedule(connection, "nightly")
        [entry] = list_audit(connection, schedule="nightly", limit=1)
    assert (task.name, task.queue, task.state, task.priority) == ("report", "reports",
                                                                 "pending", 3)
    # The template's headers, plus the occurrence a handler reads as ctx.scheduled_for.
    occurrence = {
        "name": "nightly",
        "scheduled_for": task.scheduled_for.astimezone(timezone.utc).isoformat(),
    }
    assert (task.payload, task.headers) == (
        {"kind": "daily"}, {"team": "ops", SCHEDULE_HEADER: occurrence}
    )
    assert (task.max_attempts, task.timeout_seconds) == (4, 60)
    assert task.schedule_name == "nightly"
    assert before <= task.scheduled_for == task.run_at <= after  # database time, moved
    assert info is not None
    assert info.next_run_at == cursor
    assert info.last_task_id == task_id
    assert (entry.action, entry.actor, entry.reason) == ("schedule.run_now", "ops", "late data")
    assert (entry.task_id, entry.queue) == (task_id, "reports")
    assert entry.details == {"scheduled_for": task.scheduled_for.isoformat()}


def test_run_now_joins_the_callers_transaction_and_a_paused_schedule_runs_too(
    pgtask_engine: Engine,
) -> None:
    _nightly(pgtask_engine)
    with pgtask_engine.begin() as connection:
        pause_schedule(connection, "nightly")
    before = _counts(pgtask_engine)

    with Session(pgtask_engine) as session:
        run_schedule_now(session, "nightly")
        session.rollback()
    assert _counts(pgtask_engine) == before

    with Session(pgtask_engine) as session:
        first = run_schedule_now(session, "nightly")
        second = run_schedule_now(session, "nightly")
        session.commit()
    assert first != second
    assert _counts(pgtask_engine) == (before[0] + 2, before[1] + 2)


async def test_run_now_async_enqueues_one_occurrence(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    _nightly(pgtask_engine)
    engine = create_async_engine(pgtask_database_url.replace("postgresql://",
                                                             "postgresql+psycopg://", 1))
    try:
        async with AsyncSession(engine) as session:
            task_id = await run_schedule_now_async(session, "nightly", actor="ops")
            await session.commit()
    finally:
        await engine.dispose()

    with pgtask_engine.connect() as connection:
        name = connection.scalar(select(Task.schedule_name).where(Task.id == task_id))
    assert name == "nightly"


def test_bad_names_are_refused_before_any_sql_and_unknown_ones_write_nothing(
    pgtask_engine: Engine,
) -> None:
    before = _counts(pgtask_engine)
    with Session(pgtask_engine) as session:
        with pytest.raises(InvalidNameError):
            run_schedule_now(session, "no spaces allowed")
        with pytest.raises(ScheduleNotFound):
            run_schedule_now(session, "missing")
        session.commit()
    assert _counts(pgtask_engine) == before


def test_the_admin_level_may_not_run_now_and_nothing_is_written(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    """The admin level cannot enqueue (docs/roles.md): run now needs the producer's insert."""
    _nightly(pgtask_engine)
    before = _counts(pgtask_engine)
    with login_roles(pgtask_database_url) as roles, \
            role_engine(pgtask_database_url, roles.admin) as admin:
        with Session(admin) as session, pytest.raises(DBAPIError) as refused:
            run_schedule_now(session, "nightly", actor="ops")
        assert sqlstate_of(refused.value) == "42501"
    assert _counts(pgtask_engine) == before
