"""Schedules in an IANA time zone across daylight-saving changes (Europe/Berlin, 2030:
clocks go forward on 31 March at 02:00 CET and back on 27 October at 03:00 CEST).

A fixed-time expression runs once when its wall time does not exist (right after the gap) and
once when it happens twice (the first time); an expression with a wildcard minute or hour
follows real time. Checked on the computation, then end to end with database time moved
across both changes."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import InvalidOptionError, Task
from sqlalchemy_pgtask.schedule import get_schedule, materialize_schedules, set_schedule
from sqlalchemy_pgtask.schedule.misfire import plan_occurrences
from sqlalchemy_pgtask.schedule.recurrence import Recurrence, RecurrenceError
from sqlalchemy_pgtask.schedule.spec import schedule_spec
from sqlalchemy_pgtask.testing import DatabaseClock

UTC = timezone.utc


def utc(month: int, day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2030, month, day, hour, minute, tzinfo=UTC)


def walk(expression: str, start: datetime, until: datetime) -> list[datetime]:
    """Every occurrence in (start, until], forwards; checked against `latest` backwards."""
    recurrence = Recurrence.of(expression, None, "Europe/Berlin")
    found = []
    at = recurrence.next_after(start)
    while at <= until:
        found.append(at)
        at = recurrence.next_after(at)
    for index, occurrence in enumerate(found):
        assert recurrence.latest(occurrence) == occurrence
        if index:
            before = recurrence.latest(occurrence - timedelta(microseconds=1))
            assert before == found[index - 1]
    return found


# Spring forward: 2030-03-31 01:00 UTC is 02:00 CET -> 03:00 CEST.
GAP = utc(3, 31, 1)
# Fall back: 2030-10-27 01:00 UTC is 03:00 CEST -> 02:00 CET.
OVERLAP = utc(10, 27, 1)


def test_a_fixed_time_in_the_spring_gap_runs_once_right_after_it() -> None:
    runs = walk("30 2 * * *", utc(3, 29, 12), utc(4, 1, 12))
    assert runs == [utc(3, 30, 1, 30), GAP, utc(4, 1, 0, 30)]  # 02:30 CET, 03:00 CEST, 02:30


def test_a_fixed_time_in_the_autumn_overlap_runs_once_the_first_time() -> None:
    runs = walk("30 2 * * *", utc(10, 25, 12), utc(10, 28, 12))
    assert runs == [utc(10, 26, 0, 30), utc(10, 27, 0, 30), utc(10, 28, 1, 30)]


def test_every_fixed_minute_of_a_missing_hour_collapses_into_one_run() -> None:
    runs = walk("0,15,30,45 2 * * *", utc(3, 30, 12), utc(3, 31, 12))
    assert runs == [GAP]


def test_a_wildcard_hour_follows_real_time_across_both_changes() -> None:
    spring = walk("0 * * * *", utc(3, 30, 21, 59), utc(3, 31, 3))
    assert spring == [utc(3, 30, 22), utc(3, 30, 23), utc(3, 31, 0), utc(3, 31, 1),
                      utc(3, 31, 2), utc(3, 31, 3)]  # hourly in real time: 02:00 never was
    autumn = walk("30 * * * *", utc(10, 26, 22), utc(10, 27, 3))
    # 02:30 CEST (00:30 UTC) and 02:30 CET (01:30 UTC) both run: still one run an hour.
    assert autumn == [utc(10, 26, 22, 30), utc(10, 26, 23, 30), utc(10, 27, 0, 30),
                      utc(10, 27, 1, 30), utc(10, 27, 2, 30)]


def test_a_six_field_expression_in_a_zone_keeps_its_seconds() -> None:
    runs = walk("15 30 2 * * *", utc(10, 26, 12), utc(10, 28, 12))
    assert runs == [utc(10, 27, 0, 30) + timedelta(seconds=15),
                    utc(10, 28, 1, 30) + timedelta(seconds=15)]


@pytest.mark.parametrize(
    ("start", "downtime", "expected"),
    [
        (utc(3, 30, 12), 24, [GAP]),
        (utc(10, 26, 12), 24, [utc(10, 27, 0, 30)]),
    ],
)
def test_materialised_across_a_change_each_occurrence_runs_once(
    pgtask_engine: Engine,
    pgtask_clock: DatabaseClock,
    start: datetime,
    downtime: int,
    expected: list[datetime],
) -> None:
    pgtask_clock.set_offset((start - datetime.now(UTC)).total_seconds())
    with Session(pgtask_engine) as session:
        set_schedule(session, "nightly", task="job", cron="30 2 * * *",
                     timezone="Europe/Berlin", misfire="catch_up", catch_up_limit=100)
        session.commit()
    pgtask_clock.advance(downtime * 3600)
    materialize_schedules(pgtask_engine)
    with Session(pgtask_engine) as session:
        runs = session.execute(select(Task.scheduled_for).order_by(Task.scheduled_for))
        assert [r.astimezone(UTC) for r in runs.scalars() if r is not None] == expected
        info = get_schedule(session, "nightly")
    assert info is not None
    assert info.next_run_at > expected[-1]
    assert info.upcoming[0] == info.next_run_at


def test_overlap_skip_lets_a_catch_up_create_one_occurrence_at_a_time() -> None:
    # Occurrences must not run side by side: a catch-up under overlap "skip" creates only the
    # newest missed one; the next waits for it to finish.
    recurrence = Recurrence.of("0 * * * *", None, "UTC")
    cursor = datetime(2030, 6, 3, 0, tzinfo=timezone.utc)
    now = datetime(2030, 6, 3, 5, 30, tzinfo=timezone.utc)
    allowed = plan_occurrences(recurrence, cursor=cursor, now=now, misfire="catch_up",
                               catch_up_limit=10, previous_active=False, overlap="allow")
    skipped = plan_occurrences(recurrence, cursor=cursor, now=now, misfire="catch_up",
                               catch_up_limit=10, previous_active=False, overlap="skip")
    assert len(allowed.due) == 6
    assert skipped.due == [datetime(2030, 6, 3, 5, tzinfo=timezone.utc)]
    assert skipped.next_run_at == allowed.next_run_at


def test_a_wildcard_walking_into_the_gap_resumes_at_its_first_wall_after() -> None:
    # The walls of the missing hour are jumped over at once, and the first one after the
    # gap (03:00 CEST) is not jumped with them.
    assert walk("* 2,3 * * *", utc(3, 31, 0, 58), utc(3, 31, 1, 2)) == [
        utc(3, 31, 1), utc(3, 31, 1, 1), utc(3, 31, 1, 2)
    ]
    assert walk("*/20 * * * * *", utc(3, 31, 0, 59), utc(3, 31, 1, 0)) == [
        utc(3, 31, 0, 59) + timedelta(seconds=s) for s in (20, 40, 60)
    ]


@pytest.mark.parametrize("expression", ["* 2 * 3 0#5", "* * 2 * 3 0#5", "*/10 * 2 * 3 0#5"])
def test_an_expression_that_only_falls_into_gaps_is_refused_without_walking_them(
    expression: str,
) -> None:
    # The fifth Sunday of March, when there is one, is the last: the day Berlin's 02:00 hour
    # does not exist. Each gap is one jump, so the search ends at its 50-year horizon (it
    # walked 200,000 walls one by one before, 8 to 27 s, and gave up on "too many steps").
    with pytest.raises(InvalidOptionError, match="no occurrence within 50 years"):
        schedule_spec("gaps", task_name="job", queue="default", cron=expression,
                      timezone="Europe/Berlin")
    recurrence = Recurrence.of(expression, None, "Europe/Berlin")
    with pytest.raises(RecurrenceError, match="no occurrence within 50 years"):
        recurrence.latest(utc(6, 1, 0))
