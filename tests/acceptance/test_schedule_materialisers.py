"""Leaderless materialisation: 8 materialiser processes racing on one schedule create each
occurrence exactly once over a simulated day, and a catch-up after a long downtime is bounded
by its policy. Database time is moved with the clock, never slept."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import Task
from sqlalchemy_pgtask.models import Schedule
from sqlalchemy_pgtask.schedule import set_schedule
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support.waiting import PATIENCE, wait_until

UTC = timezone.utc
ROOT = Path(__file__).resolve().parents[2]
MATERIALISERS = 8
DAY = 24 * 60  # minutes
T0 = datetime(2030, 6, 3, 0, 0, 30, tzinfo=UTC)


class Materialisers:
    def __init__(self, url: str, directory: Path) -> None:
        self._stop = directory / "stop"
        self._processes = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.schedule_app", url, str(self._stop)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for _ in range(MATERIALISERS)
        ]

    def wait_ready(self) -> None:
        for process in self._processes:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready"

    def stop(self) -> list[int]:
        """Stop them all; the tasks each one created."""
        self._stop.touch()
        created = []
        for process in self._processes:
            out, err = process.communicate(timeout=PATIENCE)
            assert process.returncode == 0, err
            created.append(int(out.split()[-1]))
        return created

    def kill(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def materialisers(pgtask_database_url: str, tmp_path: Path) -> Iterator[Materialisers]:
    launched = Materialisers(pgtask_database_url, tmp_path)
    try:
        yield launched
    finally:
        launched.kill()


def schedule(engine: Engine, name: str, cron: str = "* * * * *", **options: object) -> None:
    with Session(engine) as session:
        set_schedule(session, name, task="tick", cron=cron, **options)  # type: ignore[arg-type]
        session.commit()


def caught_up(engine: Engine, *names: str) -> bool:
    """Every schedule's cursor is past database now: nothing due is left."""
    with engine.connect() as connection:
        behind = connection.execute(
            select(func.count()).select_from(Schedule)
            .where(Schedule.name.in_(names), Schedule.next_run_at <= NOW)
        ).scalar_one()
    return behind == 0


def minutes_of(engine: Engine, name: str) -> list[datetime]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(Task.scheduled_for).where(Task.schedule_name == name)
            .order_by(Task.scheduled_for)
        ).scalars()
        return [r.astimezone(UTC) for r in rows if r is not None]


def cursor_of(engine: Engine, name: str) -> datetime:
    with engine.connect() as connection:
        value = connection.execute(
            select(Schedule.next_run_at).where(Schedule.name == name)
        ).scalar_one()
    return value.astimezone(UTC)


def test_eight_materialisers_create_every_minute_of_a_day_exactly_once(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock, materialisers: Materialisers
) -> None:
    pgtask_clock.set_offset((T0 - datetime.now(UTC)).total_seconds())
    schedule(pgtask_engine, "minutely", misfire="catch_up", catch_up_limit=10_000)
    materialisers.wait_ready()
    rng = random.Random(8)
    moved = 0
    while moved < DAY * 60:
        step = min(rng.choice((60, 60, 60, 120, 180, 300)), DAY * 60 - moved)
        pgtask_clock.advance(step)
        moved += step
    wait_until(lambda: caught_up(pgtask_engine, "minutely"), PATIENCE, message="a caught-up day")
    created = materialisers.stop()
    minutes = minutes_of(pgtask_engine, "minutely")
    first = datetime(2030, 6, 3, 0, 1, tzinfo=UTC)
    last = cursor_of(pgtask_engine, "minutely") - timedelta(minutes=1)
    count = int((last - first) / timedelta(minutes=1)) + 1
    expected = [first + timedelta(minutes=m) for m in range(count)]
    assert len(expected) >= DAY
    assert minutes == expected  # every minute present, in order, none twice
    assert len(set(minutes)) == len(minutes)
    assert sum(created) == len(minutes)  # no process reported a task that is not there
    assert sum(1 for n in created if n) >= 2  # the work really was shared


def test_a_catch_up_after_a_long_downtime_is_bounded_by_its_policy(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock, materialisers: Materialisers
) -> None:
    pgtask_clock.set_offset((T0 - datetime.now(UTC)).total_seconds())
    schedule(pgtask_engine, "bounded", misfire="catch_up", catch_up_limit=50)
    schedule(pgtask_engine, "latest")
    schedule(pgtask_engine, "skipping", cron="0 * * * *", misfire="skip")
    materialisers.wait_ready()
    with Session(pgtask_engine) as session:  # down: the materialisers see nothing due
        session.execute(update(Schedule).values(paused_at=func.now()))
        # Three days pass, ending 20 minutes past an hour: the newest hourly occurrence is
        # late by more than a minute, so "skip" drops it too.
        pgtask_clock.advance(3 * DAY * 60 + 20 * 60)
        session.execute(update(Schedule).values(paused_at=None))  # back up, all at once
        session.commit()
    wait_until(lambda: caught_up(pgtask_engine, "bounded", "latest", "skipping"), PATIENCE,
               message="caught up")
    materialisers.stop()
    bounded = minutes_of(pgtask_engine, "bounded")
    cursor = cursor_of(pgtask_engine, "bounded")
    # The newest, on time (within the grace), and the 50 missed ones before it.
    assert bounded == [cursor - timedelta(minutes=51 - m) for m in range(51)]
    assert minutes_of(pgtask_engine, "latest") == [
        cursor_of(pgtask_engine, "latest") - timedelta(minutes=1)
    ]
    assert minutes_of(pgtask_engine, "skipping") == []
