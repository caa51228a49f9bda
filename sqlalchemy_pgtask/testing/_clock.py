"""testing._clock: moves the database clock (``pgtask.now()``) of one database, for tests only.

Every pgtask deadline is computed by ``pgtask.now()`` (``statement_timestamp()``). Replacing
its body with ``statement_timestamp() + <offset>`` moves the clock of every connection to that
database at once, workers included, so lease expiry, retry delays and scheduled tasks are
tested by moving time instead of waiting for it. The planner inlines the function, and
replacing it invalidates cached plans that used it.

Never use this on a database that serves real work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from sqlalchemy import Connection, Engine, create_engine, func, select, text

from sqlalchemy_pgtask._connection import READY_CHANNEL, WAKE_ALL
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.validation import check_seconds

__all__ = [
    "DatabaseClock",
    "database_clock_offset",
    "move_database_clock",
    "reset_database_clock",
    "set_database_clock_offset",
]

Bind = Engine | Connection | str


@contextlib.contextmanager
def _transaction(bind: Bind) -> Iterator[Connection]:
    if isinstance(bind, Connection):
        yield bind
        return
    engine = create_engine(bind) if isinstance(bind, str) else bind
    try:
        with engine.begin() as connection:
            yield connection
    finally:
        if isinstance(bind, str):
            engine.dispose()


def _seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def database_clock_offset(bind: Bind) -> float:
    """How many seconds ``pgtask.now()`` runs ahead of (or, negative, behind) real time."""
    with _transaction(bind) as connection:
        offset = connection.execute(
            select(func.extract("epoch", NOW - func.statement_timestamp()))
        ).scalar_one()
    return float(offset)


def set_database_clock_offset(bind: Bind, offset: float | timedelta) -> None:
    """Make ``pgtask.now()`` run ``offset`` seconds ahead of real time (negative: behind).

    Idle workers are woken (a ``pgtask_ready`` notification to every queue) to look at the
    clock again. With a `Connection`, it takes effect when the caller commits.
    """
    seconds = _seconds(offset)
    check_seconds("offset", abs(seconds))  # finite
    micros = round(seconds * 1_000_000)  # an int: nothing but digits reaches the SQL text
    body = (
        "SELECT statement_timestamp()"
        if micros == 0
        else f"SELECT statement_timestamp() + interval '{micros} microseconds'"
    )
    with _transaction(bind) as connection:
        connection.execute(
            text(
                "CREATE OR REPLACE FUNCTION pgtask.now() RETURNS timestamptz"
                f" LANGUAGE sql STABLE PARALLEL SAFE AS $$ {body} $$"
            )
        )
        connection.execute(select(func.pg_notify(READY_CHANNEL, WAKE_ALL)))


def move_database_clock(bind: Bind, seconds: float | timedelta) -> float:
    """Move ``pgtask.now()`` by ``seconds`` (forward, or back if negative); returns the offset."""
    with _transaction(bind) as connection:
        offset = database_clock_offset(connection) + _seconds(seconds)
        set_database_clock_offset(connection, offset)
    return offset


def reset_database_clock(bind: Bind) -> None:
    """Back to real time."""
    set_database_clock_offset(bind, 0.0)


class DatabaseClock:
    """The clock of one database, for tests: ``clock.advance(3600)`` and the next hour passed.

    The ``pgtask_clock`` pytest fixture gives one for the test's own database.
    """

    def __init__(self, bind: Engine | str) -> None:
        self._bind = bind

    @property
    def offset(self) -> float:
        """Seconds ahead of real time."""
        return database_clock_offset(self._bind)

    def advance(self, seconds: float | timedelta) -> float:
        """Move the clock forward by ``seconds``; returns the new offset."""
        return move_database_clock(self._bind, seconds)

    def set_offset(self, offset: float | timedelta) -> None:
        set_database_clock_offset(self._bind, offset)

    def reset(self) -> None:
        reset_database_clock(self._bind)
