"""_enqueue_copy: large `enqueue_many` batches sent with ``COPY`` on the caller's connection.

A batch of `COPY_MIN_ROWS` or more validated rows without idempotency keys or delays is
copied instead of inserted: no parameter arrays to build, the same transaction, the same
insert triggers (capacity admission, the ready notification). Keys need ``ON CONFLICT`` and
delays need the database's clock added to them, so those batches keep the statement; so does
a driver other than psycopg. Rows without ``run_at`` get ``pgtask.now()``, read in the same
transaction just before the ``COPY``, as the statement's ``run_at`` would (the column default is
``statement_timestamp()``, which a test's moved database clock does not move).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

if TYPE_CHECKING:
    from sqlalchemy_pgtask._enqueue_plan import TaskRow

__all__ = ["COPY_MIN_ROWS", "copy_rows", "copy_rows_async", "copy_rows_sync"]

#: The smallest batch sent with ``COPY``: below it a statement's arrays cost less than
#: ``COPY``'s extra protocol messages.
COPY_MIN_ROWS: Final = 100

_COPY_TASKS: Final = (
    "COPY pgtask.tasks (id, queue, name, version, payload, headers, priority, max_attempts, "
    "timeout_seconds, run_at) FROM STDIN"
)
_NOW: Final = "SELECT pgtask.now()"

Rows = list[tuple[Any, ...]]


def copy_rows(rows: Sequence[TaskRow]) -> Rows | None:
    """The rows as ``COPY`` rows (``run_at`` last, None for database time), or None when the
    batch needs the statement: too small, or a delay."""
    if len(rows) < COPY_MIN_ROWS or any(row.delay for row in rows):
        return None
    return [
        (r.id, r.queue, r.name, r.version, r.payload, r.headers, r.priority, r.max_attempts,
         r.timeout, r.run_at)
        for r in rows
    ]


def _timed(rows: Rows, now: Any) -> Iterator[tuple[Any, ...]]:
    for row in rows:
        yield row if row[-1] is not None else (*row[:-1], now)


def _needs_now(rows: Rows) -> bool:
    return any(row[-1] is None for row in rows)


def copy_rows_sync(connection: Connection, rows: Rows) -> bool:
    """``COPY`` ``rows`` in ``connection``'s transaction (begun if it was not); False, having
    sent nothing, when the driver is not psycopg. Errors are raised as SQLAlchemy would."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        return False
    if not connection.in_transaction():
        connection.begin()  # what a statement's autobegin would have done
    try:
        with driver.cursor() as cursor:
            now = cursor.execute(_NOW).fetchone()[0] if _needs_now(rows) else None  # type: ignore[index]
            with cursor.copy(_COPY_TASKS) as copy:
                for row in _timed(rows, now):
                    copy.write_row(row)
    except psycopg.Error as exc:
        raise DBAPIError.instance(_COPY_TASKS, None, exc, psycopg.Error) from exc
    return True


async def copy_rows_async(connection: AsyncConnection, rows: Rows) -> bool:
    """`copy_rows_sync` on an `AsyncConnection`."""
    driver = (await connection.get_raw_connection()).driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        return False
    if not connection.in_transaction():
        await connection.begin()
    try:
        async with driver.cursor() as cursor:
            now = None
            if _needs_now(rows):
                now = (await (await cursor.execute(_NOW)).fetchone())[0]  # type: ignore[index]
            async with cursor.copy(_COPY_TASKS) as copy:
                for row in _timed(rows, now):
                    await copy.write_row(row)
    except psycopg.Error as exc:
        raise DBAPIError.instance(_COPY_TASKS, None, exc, psycopg.Error) from exc
    return True
