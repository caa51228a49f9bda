"""The transition-matrix rows of operations, with a failure before and after each commit.

* Materialise schedule: before commit, no task and no advance; after commit, the task and the
  cursor advance together; another materialiser takes over what a failed one left.
* Retention delete: before commit, the rows remain; after commit, the finished rows (and what
  hangs off them) are gone; a later pass takes what a failed one left.

A failure is a rolled-back transaction or a connection killed mid-transaction
(``pg_terminate_backend``), which PostgreSQL rolls back the same way.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Attempt,
    Schedule,
    Task,
    enqueue,
    materialize_schedules,
    run_retention,
    set_schedule,
)
from sqlalchemy_pgtask.statements import retention as retention_statements
from sqlalchemy_pgtask.testing import DatabaseClock

UTC = timezone.utc
T0 = datetime(2030, 6, 3, 10, 0, 30, tzinfo=UTC)


@pytest.fixture
def minutely(pgtask_engine: Engine, pgtask_clock: DatabaseClock) -> datetime:
    """A once-a-minute schedule whose first occurrence (10:01) is due; yields it."""
    pgtask_clock.set_offset((T0 - datetime.now(UTC)).total_seconds())
    with Session(pgtask_engine) as session:
        set_schedule(session, "minutely", task="job", cron="* * * * *")
        session.commit()
    pgtask_clock.advance(45)  # 10:01:15
    return datetime(2030, 6, 3, 10, 1, tzinfo=UTC)


def occurrences(engine: Engine) -> list[datetime]:
    with engine.connect() as conn:
        return [
            at.astimezone(UTC)
            for at in conn.execute(
                select(Task.scheduled_for).where(Task.schedule_name == "minutely")
                .order_by(Task.scheduled_for)
            ).scalars()
            if at is not None
        ]


def cursor(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(
            select(Schedule.next_run_at).where(Schedule.name == "minutely")
        ).scalar_one()
    return value.astimezone(UTC)


def kill(victim: Connection, engine: Engine) -> None:
    pid = victim.execute(select(func.pg_backend_pid())).scalar_one()
    with engine.connect() as killer:
        killer.execute(select(func.pg_terminate_backend(pid)))


# -- materialise schedule ------------------------------------------------------------------


def test_materialise_failure_before_commit_leaves_no_task_and_no_advance(
    pgtask_engine: Engine, minutely: datetime
) -> None:
    with pgtask_engine.connect() as conn, conn.begin() as transaction:
        report = materialize_schedules(conn)
        assert report.created == 1
        transaction.rollback()
    assert occurrences(pgtask_engine) == []
    assert cursor(pgtask_engine) == minutely
    # Another scheduler retries: the occurrence is created once, and the cursor moves on.
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine) == [minutely]
    assert cursor(pgtask_engine) == minutely + timedelta(minutes=1)


def test_a_materialiser_killed_mid_transaction_leaves_nothing_and_another_takes_over(
    pgtask_engine: Engine, minutely: datetime
) -> None:
    victim = pgtask_engine.connect()
    try:
        victim.begin()
        materialize_schedules(victim)
        kill(victim, pgtask_engine)
        with pytest.raises(DBAPIError):
            victim.execute(text("COMMIT"))
    finally:
        victim.invalidate()
        victim.close()
    assert occurrences(pgtask_engine) == []
    assert cursor(pgtask_engine) == minutely
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine) == [minutely]


def test_materialise_after_commit_shows_the_task_and_the_advance_together(
    pgtask_engine: Engine, minutely: datetime
) -> None:
    with pgtask_engine.connect() as conn, conn.begin():
        materialize_schedules(conn)
        # Uncommitted: others see neither the task nor the advance, and a racing materialiser
        # skips the locked schedule instead of creating the occurrence again.
        assert occurrences(pgtask_engine) == []
        assert cursor(pgtask_engine) == minutely
        assert materialize_schedules(pgtask_engine).created == 0
    assert occurrences(pgtask_engine) == [minutely]
    assert cursor(pgtask_engine) == minutely + timedelta(minutes=1)
    # Committed: a later pass has nothing left to do for this occurrence.
    assert materialize_schedules(pgtask_engine).created == 0
    assert occurrences(pgtask_engine) == [minutely]


# -- retention delete ----------------------------------------------------------------------


def finished_long_ago(engine: Engine, count: int) -> list[object]:
    """``count`` succeeded tasks with an attempt each, finished thirty days ago."""
    with engine.begin() as conn:
        ids = [enqueue(conn, "job").id for _ in range(count)]
        conn.execute(
            text(
                "UPDATE pgtask.tasks SET state = 'succeeded', attempt = 1, max_attempts = 1,"
                " completed_at = now() - interval '30 days' WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
        conn.execute(
            text(
                "INSERT INTO pgtask.attempts (task_id, attempt, lease_token, state,"
                " finished_at) SELECT id, 1, gen_random_uuid(), 'succeeded', completed_at"
                " FROM pgtask.tasks WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
    return list(ids)


def remaining(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        tasks = conn.execute(select(func.count()).select_from(Task)).scalar_one()
        attempts = conn.execute(select(func.count()).select_from(Attempt)).scalar_one()
    return tasks, attempts


def delete_batch(conn: Connection) -> int:
    return len(
        conn.execute(
            retention_statements.DELETE_FINISHED_TASKS, {"queue": None, "limit": 100}
        ).all()
    )


def test_retention_failure_before_commit_leaves_the_rows_for_a_later_pass(
    pgtask_engine: Engine,
) -> None:
    finished_long_ago(pgtask_engine, 5)
    with pgtask_engine.connect() as conn, conn.begin() as transaction:
        assert delete_batch(conn) == 5
        transaction.rollback()
    assert remaining(pgtask_engine) == (5, 5)
    victim = pgtask_engine.connect()
    try:
        victim.begin()
        assert delete_batch(victim) == 5
        kill(victim, pgtask_engine)
        with pytest.raises(DBAPIError):
            victim.execute(text("COMMIT"))
    finally:
        victim.invalidate()
        victim.close()
    assert remaining(pgtask_engine) == (5, 5)
    # The later bounded pass.
    assert run_retention(pgtask_engine).tasks_deleted == 5
    assert remaining(pgtask_engine) == (0, 0)


def test_retention_after_commit_removes_the_finished_rows_and_their_attempts(
    pgtask_engine: Engine,
) -> None:
    finished_long_ago(pgtask_engine, 3)
    with pgtask_engine.begin() as conn:
        live = enqueue(conn, "job").id
    with pgtask_engine.connect() as conn, conn.begin():
        assert delete_batch(conn) == 3
        assert remaining(pgtask_engine) == (4, 3)  # not yet: uncommitted
    assert remaining(pgtask_engine) == (1, 0)
    with pgtask_engine.connect() as conn:
        assert conn.execute(select(Task.id)).scalars().all() == [live]
    assert run_retention(pgtask_engine).tasks_deleted == 0


def test_retention_keeps_a_finished_child_while_its_parent_is_unfinished(
    pgtask_engine: Engine,
) -> None:
    # A running parent may still ask for the child's result (after a sleep or a retry): the
    # child, finished long ago, stays until its parent is finished too.
    [parent, child] = finished_long_ago(pgtask_engine, 2)
    with pgtask_engine.begin() as conn:
        conn.execute(
            text("UPDATE pgtask.tasks SET state = 'waiting', completed_at = NULL"
                 " WHERE id = :parent"),
            {"parent": parent},
        )
        conn.execute(
            text("UPDATE pgtask.tasks SET parent_id = :parent WHERE id = :child"),
            {"parent": parent, "child": child},
        )
    assert run_retention(pgtask_engine).tasks_deleted == 0
    with pgtask_engine.begin() as conn:
        conn.execute(
            text("UPDATE pgtask.tasks SET state = 'succeeded',"
                 " completed_at = now() - interval '30 days' WHERE id = :parent"),
            {"parent": parent},
        )
    assert run_retention(pgtask_engine).tasks_deleted == 2  # the child, then the parent
    assert remaining(pgtask_engine) == (0, 0)
