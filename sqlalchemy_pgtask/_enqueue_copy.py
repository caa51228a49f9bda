"""_enqueue_copy: large `enqueue_many` batches sent with ``COPY`` on the caller's connection.

A batch of `COPY_MIN_ROWS` or more validated rows without idempotency keys or delays is
copied instead of inserted: no parameter arrays to build, the same transaction, the same
insert triggers (capacity admission, the ready notification). Keys need ``ON CONFLICT`` and
delays need the database's clock, so those batches keep the statement; so does a driver
other than psycopg.
"""

from __future__ import annotations

from collections.abc import Sequence
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
#: Without ``run_at``: its default, database time, applies.
_COPY_TASKS_NOW: Final = _COPY_TASKS.replace(", run_at)", ")")

Rows = list[tuple[Any, ...]]


def copy_rows(rows: Sequence[TaskRow]) -> Rows | None:
    """The rows as ``COPY`` rows, or None when the batch needs the statement: too small, a
    delay, or explicit and default ``run_at`` mixed (one ``COPY`` has one column list)."""
    if len(rows) < COPY_MIN_ROWS or any(row.delay for row in rows):
        return None
    explicit = [row.run_at is not None for row in rows]
    if any(explicit) and not all(explicit):
        return None
    if explicit[0]:
        return [
            (r.id, r.queue, r.name, r.version, r.payload, r.headers, r.priority,
             r.max_attempts, r.timeout, r.run_at)
            for r in rows
        ]
    return [
        (r.id, r.queue, r.name, r.version, r.payload, r.headers, r.priority, r.max_attempts,
         r.timeout)
        for r in rows
    ]


def _command(rows: Rows) -> str:
    return _COPY_TASKS if len(rows[0]) == 10 else _COPY_TASKS_NOW


def copy_rows_sync(connection: Connection, rows: Rows) -> bool:
    """``COPY`` ``rows`` in ``connection``'s transaction (begun if it was not); False, having
    sent nothing, when the driver is not psycopg. Errors are raised as SQLAlchemy would."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        return False
    if not connection.in_transaction():
        connection.begin()  # what a statement's autobegin would have done
    command = _command(rows)
    try:
        with driver.cursor() as cursor, cursor.copy(command) as copy:
            for row in rows:
                copy.write_row(row)
    except psycopg.Error as exc:
        raise DBAPIError.instance(command, None, exc, psycopg.Error) from exc
    return True


async def copy_rows_async(connection: AsyncConnection, rows: Rows) -> bool:
    """`copy_rows_sync` on an `AsyncConnection`."""
    driver = (await connection.get_raw_connection()).driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        return False
    if not connection.in_transaction():
        await connection.begin()
    command = _command(rows)
    try:
        async with driver.cursor() as cursor, cursor.copy(command) as copy:
            for row in rows:
                await copy.write_row(row)
    except psycopg.Error as exc:
        raise DBAPIError.instance(command, None, exc, psycopg.Error) from exc
    return True
