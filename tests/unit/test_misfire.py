"""The grace and the misfire policies (`sqlalchemy_pgtask.schedule.misfire`): an occurrence late by
at most the grace is created under every policy; only older ones are missed and decided by
the policy. Pure: no database.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from sqlalchemy_pgtask.schedule.misfire import MISFIRE_GRACE, Occurrences, grace, plan_occurrences
from sqlalchemy_pgtask.schedule.recurrence import Recurrence

UTC = timezone.utc
T0 = datetime(2030, 6, 3, 10, 0, tzinfo=UTC)
SECOND = Recurrence.of(None, 1, "UTC")
MINUTE = Recurrence.of("* * * * *", None, "UTC")
HOURLY = Recurrence.of("0 * * * *", None, "UTC")
POLICIES = [("skip", None), ("latest", None), ("catch_up", 1)]


def plan(
    recurrence: Recurrence, late: float, misfire: str, limit: int | None = None, **extra: object
) -> Occurrences:
    """The plan at ``late`` seconds after the cursor T0."""
    return plan_occurrences(
        recurrence, cursor=T0, now=T0 + timedelta(seconds=late), misfire=misfire,
        catch_up_limit=limit, previous_active=False, **extra,  # type: ignore[arg-type]
    )


def seconds(*offsets: float) -> list[datetime]:
    return [T0 + timedelta(seconds=s) for s in offsets]


def test_the_grace_is_a_minute_or_ten_occurrences_if_that_is_shorter() -> None:
    assert grace(SECOND, T0, T0) == timedelta(seconds=10)
    assert grace(Recurrence.of(None, 5, "UTC"), T0, T0) == timedelta(seconds=50)
    assert grace(Recurrence.of(None, 7, "UTC"), T0, T0) == MISFIRE_GRACE
    assert grace(HOURLY, T0, T0) == MISFIRE_GRACE


@pytest.mark.parametrize(("misfire", "limit"), POLICIES)
def test_a_one_second_schedule_a_second_and_a_bit_late_loses_nothing(
    misfire: str, limit: int | None
) -> None:
    # A new schedule's first pass 1.3 s after its first occurrence: both due ones are on time.
    result = plan(SECOND, 1.3, misfire, limit)
    assert result.due == seconds(0, 1)
    assert result.next_run_at == T0 + timedelta(seconds=2)
    assert not result.dropped


@pytest.mark.parametrize(("misfire", "limit"), POLICIES)
def test_every_policy_creates_an_hourly_occurrence_late_by_less_than_a_minute(
    misfire: str, limit: int | None
) -> None:
    assert plan(HOURLY, 59, misfire, limit).due == [T0]


def test_beyond_the_grace_the_policy_decides() -> None:
    # A one-second schedule 15.5 s late: 6 .. 15 are on time (10 s grace), 0 .. 5 missed.
    on_time = seconds(*range(6, 16))
    assert plan(SECOND, 15.5, "skip").due == on_time
    assert plan(SECOND, 15.5, "latest").due == on_time  # the newest stands for the missed
    assert plan(SECOND, 15.5, "catch_up", 3).due == seconds(3, 4, 5) + on_time
    assert plan(SECOND, 15.5, "catch_up", 100).due == seconds(*range(16))
    assert all(plan(SECOND, 15.5, m, n).dropped for m, n in POLICIES)


def test_with_nothing_on_time_latest_creates_the_newest_missed_occurrence() -> None:
    assert plan(HOURLY, 3 * 3600 + 120, "latest").due == [T0 + timedelta(hours=3)]
    assert plan(HOURLY, 3 * 3600 + 120, "skip").due == []
    assert plan(HOURLY, 3 * 3600 + 120, "catch_up", 2).due == [
        T0 + timedelta(hours=2), T0 + timedelta(hours=3)
    ]


def test_a_long_downtime_lets_through_at_most_the_grace_and_the_limit() -> None:
    day = 24 * 3600.0
    assert len(plan(SECOND, day, "skip").due) == 11
    assert len(plan(SECOND, day, "latest").due) == 11
    assert len(plan(SECOND, day, "catch_up", 50).due) == 61
    assert len(plan(MINUTE, day + 30, "latest").due) == 1


def test_overlap_skip_creates_the_newest_on_time_occurrence_only() -> None:
    result = plan(SECOND, 1.3, "latest", overlap="skip")
    assert result.due == seconds(1)
    assert result.dropped


def test_an_occurrence_waiting_for_room_stays_on_time_until_a_newer_one_falls_due() -> None:
    assert plan(HOURLY, 300, "skip", waiting=True).due == [T0]
    assert plan(HOURLY, 300, "skip").due == []
    assert plan(HOURLY, 3600 + 300, "skip", waiting=True).due == []
