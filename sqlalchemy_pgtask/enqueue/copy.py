"""enqueue.copy: large `enqueue_many` batches sent with ``COPY`` on the caller's connection.

A batch of `COPY_MIN_ROWS` or more validated rows without idempotency keys or delays is
copied instead of inserted: no parameter arrays to build, the same transaction, the same
insert triggers (capacity admission, the ready notification). Keys need ``ON CONFLICT`` and
delays need the database's clock added to them, so those batches keep the statement; so does
a driver other than psycopg, and a connection whose client encoding is not UTF-8. Rows
without ``run_at`` get ``pgtask.now()``, as the statement's would: the column default
(``statement_timestamp()``) when that is the same, else (a test moved the database clock)
the value read just before the ``COPY``. A lost connection is invalidated as SQLAlchemy
invalidates it for a statement (without the engine's ``handle_error`` event, which only its
statements fire, as they alone fire the cursor events).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection

if TYPE_CHECKING:
    from sqlalchemy_pgtask.enqueue.plan import TaskRow

__all__ = ["COPY_MIN_ROWS", "copy_rows_async", "copy_rows_sync", "copyable"]

#: The smallest batch sent with ``COPY``: below it a statement's arrays cost less than
#: ``COPY``'s extra protocol messages.
COPY_MIN_ROWS: Final = 100

_COLUMNS: Final = (
    "id, queue, name, version, payload, headers, priority, max_attempts, timeout_seconds"
)
#: How many leading `TaskRow` fields `_COLUMNS` names.
_WIDTH: Final = 9
_COPY_TASKS: Final = f"COPY pgtask.tasks ({_COLUMNS}) FROM STDIN"
_COPY_TASKS_RUN_AT: Final = f"COPY pgtask.tasks ({_COLUMNS}, run_at) FROM STDIN"
#: Database time, and whether it is the statement's time (always, unless a test moved the
#: clock): then the column default gives each row the same ``run_at`` the statement would.
_NOW: Final = "SELECT pgtask.now(), pgtask.now() = statement_timestamp()"


def copyable(rows: Sequence[TaskRow]) -> bool:
    """Whether ``rows`` are sent with ``COPY`` (by a psycopg connection in UTF-8): enough of
    them, and none with an idempotency key, a delay or a concurrency key."""
    return len(rows) >= COPY_MIN_ROWS and not any(
        row.delay or row.key or row.concurrency_key for row in rows
    )


def _utf8(driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    # Rows are encoded as they are written, and an error then cancels the COPY, which aborts
    # the caller's transaction: in another client encoding a character it lacks would, where
    # the statement fails before anything is sent and leaves the transaction usable.
    return driver.info.encoding == "utf-8"


def _error(
    connection: Connection, dbapi_connection: Any, command: str, exc: psycopg.Error
) -> tuple[StatementError, bool]:
    """``exc`` as SQLAlchemy raises a statement's, and whether it lost the connection (marked
    on the error, as SQLAlchemy marks it)."""
    lost = connection.dialect.is_disconnect(cast(Any, exc), dbapi_connection, None)
    error = DBAPIError.instance(
        command, None, exc, psycopg.Error, connection_invalidated=lost,
        dialect=connection.dialect,
    )
    return error, lost


def _plan(rows: Sequence[TaskRow], now: Any, real: bool) -> tuple[str, Iterable[tuple[Any, ...]]]:
    """The ``COPY`` command and its rows, given database time ``now`` (``real``: unmoved)."""
    if real and all(row.run_at is None for row in rows):
        return _COPY_TASKS, (row[:_WIDTH] for row in rows)
    return _COPY_TASKS_RUN_AT, (
        (*row[:_WIDTH], now if row.run_at is None else row.run_at) for row in rows
    )


def copy_rows_sync(connection: Connection, rows: Sequence[TaskRow]) -> bool:
    """``COPY`` ``rows`` in ``connection``'s transaction (begun if it was not); False, having
    sent nothing, when the driver is not psycopg or the client encoding not UTF-8. Errors are
    raised as SQLAlchemy would."""
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection) or not _utf8(driver):
        return False
    if not connection.in_transaction():
        connection.begin()  # what a statement's autobegin would have done
    command = _COPY_TASKS
    try:
        with driver.cursor() as cursor:
            now, real = cursor.execute(_NOW).fetchone()  # type: ignore[misc]
            command, copied = _plan(rows, now, real)
            with cursor.copy(command) as copy:
                for row in copied:
                    copy.write_row(row)
    except psycopg.Error as exc:
        error, lost = _error(connection, connection.connection.dbapi_connection, command, exc)
        if lost:
            # As SQLAlchemy does for a statement: the caller's rollback then succeeds and the
            # pool replaces the connection.
            connection.invalidate(error)
        raise error from exc
    return True


async def copy_rows_async(connection: AsyncConnection, rows: Sequence[TaskRow]) -> bool:
    """`copy_rows_sync` on an `AsyncConnection`."""
    raw = await connection.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, psycopg.AsyncConnection) or not _utf8(driver):
        return False
    if not connection.in_transaction():
        await connection.begin()
    command = _COPY_TASKS
    try:
        async with driver.cursor() as cursor:
            now, real = await (await cursor.execute(_NOW)).fetchone()  # type: ignore[misc]
            command, copied = _plan(rows, now, real)
            async with cursor.copy(command) as copy:
                for row in copied:
                    await copy.write_row(row)
    except psycopg.Error as exc:
        sync = connection.sync_connection
        assert sync is not None  # a connection that just ran the COPY has begun
        error, lost = _error(sync, raw.dbapi_connection, command, exc)
        if lost:
            await connection.invalidate(error)
        raise error from exc
    return True
