"""Every enqueue path stores the instant ``run_at`` names, whatever its time zone says.

Four paths send ``run_at``: a single `enqueue`, a batch whose tasks share their options (one
value for all), a batch of mixed options (an array, as text) and a large batch by ``COPY``
(text). They must agree, for two kinds of value Python allows and each broke one of them:
instants of a zone's repeated hour, which Python compares equal when only ``fold`` differs,
and offsets PostgreSQL's text input refuses (16 hours or more, fractions of a second).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone, tzinfo

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import EnqueueRequest, Task, enqueue, enqueue_many
from sqlalchemy_pgtask.enqueue.copy import COPY_MIN_ROWS


class RepeatedHour(tzinfo):
    """A zone that leaves summer time at 02:00 on 2030-11-03: 01:00-02:00 happens twice, at
    UTC-4 (``fold=0``) and then at UTC-5 (``fold=1``), as in America/New_York."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        assert dt is not None
        repeated = (
            datetime(2030, 11, 3, 1) <= dt.replace(tzinfo=None, fold=0) < datetime(2030, 11, 3, 2)
        )
        if dt.replace(tzinfo=None, fold=0) < datetime(2030, 11, 3, 1) or (repeated and not dt.fold):
            return timedelta(hours=-4)
        return timedelta(hours=-5)

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)

    def tzname(self, dt: datetime | None) -> str:
        return "Repeated"


Store = Callable[[Session, list[datetime]], None]


def single(session: Session, instants: list[datetime]) -> None:
    for at in instants:
        enqueue(session, "timed", run_at=at)


def uniform_batch(session: Session, instants: list[datetime]) -> None:
    enqueue_many(session, [EnqueueRequest(name="timed", run_at=at) for at in instants])


def mixed_batch(session: Session, instants: list[datetime]) -> None:
    # Two requests at least, or a lone one would take the single enqueue's statement.
    enqueue_many(
        session,
        [
            EnqueueRequest(name="timed", run_at=at, priority=index)
            for index, at in enumerate([*instants, instants[-1]])
        ],
    )


def copied_batch(session: Session, instants: list[datetime]) -> None:
    filler = [instants[-1]] * (COPY_MIN_ROWS - len(instants))
    enqueue_many(session, [EnqueueRequest(name="timed", run_at=at) for at in instants + filler])


PATHS = pytest.mark.parametrize("store", [single, uniform_batch, mixed_batch, copied_batch])


def stored(engine: Engine, store: Store, instants: list[datetime]) -> list[datetime]:
    """The distinct ``run_at`` values stored by ``store``, in UTC, earliest first."""
    with Session(engine) as session:
        store(session, instants)
        session.commit()
    with Session(engine) as session:
        values = session.scalars(select(Task.run_at).distinct().order_by(Task.run_at)).all()
    return [value.astimezone(timezone.utc) for value in values]


@PATHS
def test_both_instants_of_a_repeated_hour_are_stored_an_hour_apart(
    pgtask_engine: Engine, store: Store
) -> None:
    zone = RepeatedHour()
    first = datetime(2030, 11, 3, 1, 30, tzinfo=zone)
    second = first.replace(fold=1)
    assert first == second  # what Python says; they are an hour apart

    assert stored(pgtask_engine, store, [first, second]) == [
        datetime(2030, 11, 3, 5, 30, tzinfo=timezone.utc),
        datetime(2030, 11, 3, 6, 30, tzinfo=timezone.utc),
    ]


@PATHS
@pytest.mark.parametrize(
    "offset",
    [
        timedelta(hours=20),
        timedelta(hours=-23, minutes=59),
        timedelta(hours=1, microseconds=500_000),
    ],
    ids=["+20:00", "-23:59", "+01:00:00.5"],
)
def test_offsets_the_database_cannot_read_as_text_are_stored_as_their_instant(
    pgtask_engine: Engine, store: Store, offset: timedelta
) -> None:
    at = datetime(2030, 1, 1, 12, tzinfo=timezone(offset))

    assert stored(pgtask_engine, store, [at]) == [at.astimezone(timezone.utc)]
