"""Schedules: definitions, misfire and overlap policies, pause/resume, redeclaration, capacity,
one bad schedule beside good ones, and validation before SQL. Database time is moved with the
clock fixture; nothing sleeps."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, event, select, text, update
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import InvalidOptionError, Task, ValidationError, configure_queue, enqueue
from sqlalchemy_pgtask.models import AuditEntry, Schedule
from sqlalchemy_pgtask.schedule import (
    ScheduleNotFound,
    delete_schedule,
    get_schedule,
    list_schedules,
    materialize_schedules,
    pause_schedule,
    resume_schedule,
    set_schedule,
)
from sqlalchemy_pgtask.testing import DatabaseClock

UTC = timezone.utc
#: A known minute of database time; tests put "now" 30 s into a minute so the seconds real
#: time adds while a test runs never cross an occurrence.
T0 = datetime(2030, 6, 3, 10, 0, 30, tzinfo=UTC)


def set_now(clock: DatabaseClock, at: datetime) -> None:
    clock.set_offset((at - datetime.now(UTC)).total_seconds())


def minute(hh: int, mm: int, day: int = 3) -> datetime:
    return datetime(2030, 6, day, hh, mm, tzinfo=UTC)


def occurrences(engine: Engine, name: str) -> list[datetime]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(Task.scheduled_for).where(Task.schedule_name == name)
            .order_by(Task.scheduled_for)
        ).scalars()
        return [r.astimezone(UTC) for r in rows if r is not None]


def cursor(engine: Engine, name: str) -> datetime:
    with Session(engine) as session:
        info = get_schedule(session, name)
    assert info is not None
    return info.next_run_at.astimezone(UTC)


def make(engine: Engine, name: str = "every-minute", **options: Any) -> None:
    options.setdefault("cron", None if "every" in options else "* * * * *")
    with Session(engine) as session:
        set_schedule(session, name, task="job", **options)
        session.commit()


def blocked(engine: Engine, queue: str, room: int = 1) -> uuid.UUID:
    """Cap ``queue`` at ``room`` outstanding tasks and take one place with another task."""
    with Session(engine) as session:
        configure_queue(session, queue, max_outstanding_tasks=room)
        blocker = enqueue(session, "other", queue=queue).id
        session.commit()
    return blocker


def end(engine: Engine, task_id: uuid.UUID, state: str = "cancelled") -> None:
    """Make a task terminal (its place in a capped queue frees up)."""
    with Session(engine) as session:
        session.execute(update(Task).where(Task.id == task_id)
                        .values(state=state, completed_at=text("statement_timestamp()")))
        session.commit()


@pytest.fixture
def at_t0(pgtask_clock: DatabaseClock) -> DatabaseClock:
    set_now(pgtask_clock, T0)
    return pgtask_clock


def test_a_cron_schedule_starts_at_its_next_occurrence_and_is_audited(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, payload={"n": 1}, priority=3, actor="ops")
    assert cursor(pgtask_engine, "every-minute") == minute(10, 1)
    with Session(pgtask_engine) as session:
        info = get_schedule(session, "every-minute", upcoming=3)
        entry = session.execute(select(AuditEntry)).scalar_one()
    assert info is not None
    assert info.upcoming == (minute(10, 1), minute(10, 2), minute(10, 3))
    assert (info.queue, info.version, info.payload, info.priority) == ("default", 1, {"n": 1}, 3)
    assert (entry.action, entry.actor, entry.schedule) == ("schedule.set", "ops", "every-minute")


def test_latest_creates_one_task_for_the_most_recent_missed_occurrence(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, payload={"k": "v"}, headers={"trace": "x"}, max_attempts=2, timeout=30)
    at_t0.advance(5 * 60)  # 10:05:30: 10:01 .. 10:05 are due
    report = materialize_schedules(pgtask_engine)
    assert report.created == 1
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 5)]
    assert cursor(pgtask_engine, "every-minute") == minute(10, 6)
    with Session(pgtask_engine) as session:
        task = session.execute(select(Task)).scalar_one()
        info = get_schedule(session, "every-minute")
    occurrence = {"name": "every-minute", "scheduled_for": "2030-06-03T10:05:00.000000+00:00"}
    assert (task.name, task.queue, task.payload, task.headers) == (
        "job", "default", {"k": "v"}, {"trace": "x", "pgtask.schedule": occurrence}
    )
    assert (task.max_attempts, task.timeout_seconds) == (2, 30.0)
    assert task.run_at.astimezone(UTC) >= minute(10, 5, 3) + timedelta(seconds=30)
    assert info is not None
    assert info.last_task_id == task.id


def test_skip_drops_every_missed_occurrence(pgtask_engine: Engine, at_t0: DatabaseClock) -> None:
    make(pgtask_engine, "five", cron="*/5 * * * *", misfire="skip")  # next: 10:05
    at_t0.advance(5 * 60)  # 10:05:30: 10:05 is 30 s late, within the 60 s grace: on time
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "five") == [minute(10, 5)]
    at_t0.advance(15 * 60)  # 10:20:30: 10:10 and 10:15 were missed, 10:20 is on time
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "five") == [minute(10, 5), minute(10, 20)]
    make(pgtask_engine, "hourly", cron="0 * * * *", misfire="skip")  # next: 11:00
    at_t0.advance(3 * 3600)  # 13:20:30: 11:00, 12:00, 13:00 all missed
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "hourly") == []
    assert cursor(pgtask_engine, "hourly") == minute(14, 0)
    make(pgtask_engine, misfire="skip")  # every minute, from 13:21
    at_t0.advance(3 * 60 + 5)  # 13:23:35: 13:21 missed; 13:22 95 s late, missed; 13:23 on time
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(13, 23)]
    assert cursor(pgtask_engine, "every-minute") == minute(13, 24)


def test_catch_up_creates_the_most_recent_missed_occurrences_up_to_its_limit(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, misfire="catch_up", catch_up_limit=3)
    make(pgtask_engine, "roomy", misfire="catch_up", catch_up_limit=100)
    at_t0.advance(10 * 60)  # 10:10:30: 10:10 on time (within the grace), nine missed
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, m) for m in (7, 8, 9, 10)]
    assert occurrences(pgtask_engine, "roomy") == [minute(10, m) for m in range(1, 11)]
    assert cursor(pgtask_engine, "every-minute") == minute(10, 11)
    materialize_schedules(pgtask_engine)  # nothing due: nothing more
    assert len(occurrences(pgtask_engine, "roomy")) == 10


def test_overlap_skip_waits_for_the_previous_occurrence_to_finish(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, overlap="skip")
    make(pgtask_engine, "overlapping")  # allow (the default)
    at_t0.advance(60)
    materialize_schedules(pgtask_engine)
    at_t0.advance(60)  # 10:02:30: the 10:01 tasks are still pending
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 1)]
    assert cursor(pgtask_engine, "every-minute") == minute(10, 3)  # 10:02 skipped
    assert occurrences(pgtask_engine, "overlapping") == [minute(10, 1), minute(10, 2)]
    with Session(pgtask_engine) as session:
        session.execute(
            update(Task).where(Task.schedule_name == "every-minute")
            .values(state="succeeded", completed_at=text("statement_timestamp()"))
        )
        session.commit()
    at_t0.advance(60)
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 1), minute(10, 3)]


def test_a_paused_schedule_creates_nothing_and_resumes_after_now(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, misfire="catch_up", catch_up_limit=100)
    with Session(pgtask_engine) as session:
        assert pause_schedule(session, "every-minute", actor="ops", reason="maintenance").paused
        session.commit()
    at_t0.advance(5 * 60)
    assert materialize_schedules(pgtask_engine).selected == 0
    with Session(pgtask_engine) as session:
        info = resume_schedule(session, "every-minute", actor="ops")
        session.commit()
        actions = session.execute(select(AuditEntry.action).order_by(AuditEntry.id)).scalars()
        assert list(actions) == ["schedule.set", "schedule.pause", "schedule.resume"]
    assert not info.paused
    assert info.next_run_at.astimezone(UTC) == minute(10, 6)  # paused occurrences skipped
    at_t0.advance(60)
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 6)]


def test_an_unchanged_redeclaration_keeps_the_cursor_and_a_changed_one_resets_it(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, payload={"a": 1})
    at_t0.advance(10 * 60)  # 10:10:30, not materialised: the cursor stays behind
    make(pgtask_engine, payload={"a": 1})
    assert cursor(pgtask_engine, "every-minute") == minute(10, 1)
    make(pgtask_engine, payload={"a": 2})
    assert cursor(pgtask_engine, "every-minute") == minute(10, 11)
    with Session(pgtask_engine) as session:
        details = session.execute(
            select(AuditEntry.details).order_by(AuditEntry.id)
        ).scalars().all()
    assert len(details) == 2  # the unchanged call wrote nothing
    assert details[1] is not None
    assert details[1]["changed"] == ["payload"]


def test_an_interval_schedule_counts_from_its_cursor(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, "interval", every=timedelta(seconds=90), misfire="catch_up",
         catch_up_limit=10, start_at=T0 + timedelta(seconds=10))
    assert cursor(pgtask_engine, "interval") == T0 + timedelta(seconds=10)
    at_t0.advance(200)  # due: +10, +100, +190
    materialize_schedules(pgtask_engine)
    start = T0 + timedelta(seconds=10)
    assert occurrences(pgtask_engine, "interval") == [
        start, start + timedelta(seconds=90), start + timedelta(seconds=180)
    ]
    assert cursor(pgtask_engine, "interval") == start + timedelta(seconds=270)


def test_a_six_field_cron_has_seconds_first(pgtask_engine: Engine, at_t0: DatabaseClock) -> None:
    make(pgtask_engine, "seconds", cron="*/10 * * * * *", misfire="catch_up", catch_up_limit=99)
    assert cursor(pgtask_engine, "seconds") == T0 + timedelta(seconds=10)
    at_t0.advance(60)
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "seconds") == [
        T0 + timedelta(seconds=s) for s in range(10, 61, 10)
    ]


def test_occurrences_are_never_duplicated_even_when_the_cursor_moves_back(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, misfire="catch_up", catch_up_limit=10)
    at_t0.advance(3 * 60)
    materialize_schedules(pgtask_engine)
    with Session(pgtask_engine) as session:
        session.execute(update(Schedule).values(next_run_at=minute(10, 1)))
        session.commit()
    assert materialize_schedules(pgtask_engine).created == 0
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, m) for m in (1, 2, 3)]


REFUSE = """
CREATE FUNCTION pgtask.refuse_test_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.name = 'refused' THEN RAISE EXCEPTION 'no such task here'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_test_task BEFORE INSERT ON pgtask.tasks
    FOR EACH ROW EXECUTE FUNCTION pgtask.refuse_test_task();
"""


def test_a_bad_schedule_never_blocks_the_others(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine, "good")
    with Session(pgtask_engine) as session:
        set_schedule(session, "refused", task="refused", cron="* * * * *")
        set_schedule(session, "unknown-zone", task="job", cron="* * * * *")
        session.execute(update(Schedule).where(Schedule.name == "unknown-zone")
                        .values(timezone="Mars/Olympus_Mons"))
        session.execute(text(REFUSE))
        session.commit()
    at_t0.advance(60)
    report = materialize_schedules(pgtask_engine)
    assert sorted(report.failed) == ["refused", "unknown-zone"]
    assert occurrences(pgtask_engine, "good") == [minute(10, 1)]
    assert occurrences(pgtask_engine, "refused") == []
    with Session(pgtask_engine) as session:
        rows = {s.name: s for s in list_schedules(session)}
    assert "no such task here" in (rows["refused"].last_error or "")
    assert "Mars/Olympus_Mons" in (rows["unknown-zone"].last_error or "")
    assert rows["good"].last_error is None
    # A failed schedule rests about a minute instead of failing on every pass.
    assert rows["refused"].next_run_at.astimezone(UTC) >= minute(10, 2, 3) + timedelta(seconds=30)
    at_t0.advance(60)
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "good") == [minute(10, 1), minute(10, 2)]


def test_a_full_queue_keeps_the_occurrence_at_the_cursor_until_there_is_room(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    blocker = blocked(pgtask_engine, "small", room=2)
    make(pgtask_engine, queue="small", misfire="catch_up", catch_up_limit=10)
    at_t0.advance(2 * 60)  # 10:01 and 10:02 due; room for one
    report = materialize_schedules(pgtask_engine)
    assert report.waiting == ["every-minute"]
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 1)]
    assert cursor(pgtask_engine, "every-minute") == minute(10, 2)
    materialize_schedules(pgtask_engine)  # still full: still waiting, nothing lost
    assert cursor(pgtask_engine, "every-minute") == minute(10, 2)
    with Session(pgtask_engine) as session:
        waiting = get_schedule(session, "every-minute")
        assert waiting is not None
        assert "waiting for room" in (waiting.last_error or "")
    end(pgtask_engine, blocker)
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 1), minute(10, 2)]
    assert cursor(pgtask_engine, "every-minute") == minute(10, 3)
    with Session(pgtask_engine) as session:
        done = get_schedule(session, "every-minute")
        assert done is not None
        assert done.last_error is None


def test_under_skip_an_occurrence_waiting_for_room_is_created_once_there_is_room(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    # skip's grace (a minute late at most) used to drop it on the first pass after a minute,
    # though no newer occurrence had fallen due.
    blocker = blocked(pgtask_engine, "small")
    make(pgtask_engine, "hourly", cron="0 * * * *", queue="small", misfire="skip")
    set_now(at_t0, minute(11, 0) + timedelta(seconds=5))
    assert materialize_schedules(pgtask_engine).waiting == ["hourly"]
    assert cursor(pgtask_engine, "hourly") == minute(11, 0)

    set_now(at_t0, minute(11, 5))  # five minutes late, the next occurrence (12:00) not due
    end(pgtask_engine, blocker)
    materialize_schedules(pgtask_engine)

    assert occurrences(pgtask_engine, "hourly") == [minute(11, 0)]
    assert cursor(pgtask_engine, "hourly") == minute(12, 0)


def test_delete_removes_the_schedule_and_keeps_its_tasks(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    make(pgtask_engine)
    at_t0.advance(60)
    materialize_schedules(pgtask_engine)
    with Session(pgtask_engine) as session:
        delete_schedule(session, "every-minute", actor="ops", reason="retired")
        session.commit()
        assert get_schedule(session, "every-minute") is None
        with pytest.raises(ScheduleNotFound):
            pause_schedule(session, "every-minute")
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 1)]


@pytest.fixture
def statements_seen(pgtask_engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(pgtask_engine, "before_cursor_execute", record)
    yield seen
    event.remove(pgtask_engine, "before_cursor_execute", record)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * * *"}, "cron"),
        ({"cron": "* * * * * * *"}, "cron"),
        ({"cron": "0 0 30 2 *"}, "cron"),
        ({"cron": "* * * * *", "every": 60}, "cron"),
        ({}, "cron"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus_Mons"}, "timezone"),
        ({"cron": "R R * * *"}, "cron"),
        ({"every": 0.5}, "every"),
        ({"every": float("nan")}, "every"),
        ({"every": 60, "timezone": "Europe/Berlin"}, "timezone"),
        ({"cron": "* * * * *", "misfire": "sometimes"}, "misfire"),
        ({"cron": "* * * * *", "misfire": "catch_up"}, "catch_up_limit"),
        ({"cron": "* * * * *", "misfire": "catch_up", "catch_up_limit": 10001}, "catch_up_limit"),
        ({"cron": "* * * * *", "catch_up_limit": 5}, "catch_up_limit"),
        ({"cron": "* * * * *", "overlap": "queue"}, "overlap"),
        ({"cron": "* * * * *", "start_at": datetime(2030, 1, 1)}, "start_at"),
        ({"cron": "* * * * *", "payload": {"x": object()}}, "payload"),
        ({"cron": "* * * * *", "priority": 40000}, "priority"),
        ({"cron": "* * * * *", "actor": ""}, "actor"),
    ],
)
def test_bad_options_are_refused_before_any_sql(
    pgtask_engine: Engine, statements_seen: list[str], options: dict[str, Any], field: str
) -> None:
    with Session(pgtask_engine) as session, pytest.raises(ValidationError) as raised:
        set_schedule(session, "bad", task="job", **options)
    assert raised.value.field == field
    assert statements_seen == []


def test_bad_names_are_refused_before_any_sql(
    pgtask_engine: Engine, statements_seen: list[str]
) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(ValidationError):
            set_schedule(session, "ok", task="job", cron="* * * * *", queue="bad queue")
        with pytest.raises(InvalidOptionError):
            set_schedule(session, "ok", task="job", cron="* * * * *", version=0)
        with pytest.raises(ValidationError):
            set_schedule(session, "bad name", task="job", cron="* * * * *")
        with pytest.raises(ValidationError):
            pause_schedule(session, "ok", reason="x" * 2000)
        with pytest.raises(ValidationError):
            materialize_schedules(session, limit=0)
    assert statements_seen == []


def test_a_full_queue_holds_back_a_latest_schedule_without_losing_its_occurrence(
    pgtask_engine: Engine, at_t0: DatabaseClock
) -> None:
    blocker = blocked(pgtask_engine, "tiny")
    make(pgtask_engine, queue="tiny")
    at_t0.advance(60)
    assert materialize_schedules(pgtask_engine).waiting == ["every-minute"]
    assert occurrences(pgtask_engine, "every-minute") == []
    assert cursor(pgtask_engine, "every-minute") == minute(10, 1)
    end(pgtask_engine, blocker, "succeeded")
    materialize_schedules(pgtask_engine)
    materialize_schedules(pgtask_engine)
    assert occurrences(pgtask_engine, "every-minute") == [minute(10, 1)]
    assert cursor(pgtask_engine, "every-minute") == minute(10, 2)


@pytest.mark.parametrize("recurrence", [{"every": 60}, {"cron": "59 23 31 12 *"}])
def test_a_schedule_near_the_end_of_the_calendar_lists_the_occurrences_there_are(
    pgtask_engine: Engine, recurrence: dict[str, Any]
) -> None:
    # The next interval occurrence after 9999-12-31 23:59 overflowed Python's datetime: set_schedule
    # raised OverflowError (a traceback from `pgtask schedule set`) instead of returning.
    last = datetime(9999, 12, 31, 23, 59, tzinfo=UTC)
    with Session(pgtask_engine) as session:
        info = set_schedule(session, "last-minute", task="job", start_at=last, **recurrence)
        session.commit()
    assert info.next_run_at.astimezone(UTC) == last
    assert [at.astimezone(UTC) for at in info.upcoming] == [last]
