"""_prepared: behind a pooler, the library's statements are never server-side prepared.

psycopg prepares a statement (``_pg3_N``) once it ran five times on a connection. Behind a
transaction pooler (PgBouncer before 1.21, or without ``max_prepared_statements``) the next
transaction may run on another server connection: "prepared statement does not exist",
`DuplicatePreparedStatement`, or another client's ``_pg3_N`` bound to ours ("bind message
supplies 14 parameters, but prepared statement requires 11"), or even run in its place. The
library's calls (enqueue, signals, cancel, retry, queue and schedule changes, reads) run on
the caller's engine, which may well go through such a pooler, so there they are never
prepared, and the caller's own ``prepare_threshold`` is put back for its own statements.
On a connection of its own psycopg prepares as usual (a generic plan, no re-planning).

A pooler is recognised once per physical connection, by one ``SELECT pg_backend_pid()`` in
the caller's transaction (sent to psycopg directly, so statement listeners and echo do not
see it): the server process it names is not the one the connection was handed at connect (a
pooler makes that up).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = ["unprepared", "unprepared_async"]

#: Per physical psycopg connection: does it reach PostgreSQL through a pooler? (`unprepared`)
_POOLED: Final[weakref.WeakKeyDictionary[Any, bool]] = weakref.WeakKeyDictionary()
_BACKEND_PID: Final = "SELECT pg_backend_pid()"


def _driver(connection: Connection | AsyncConnection) -> Any:
    """The psycopg connection under ``connection``, or None for another driver."""
    sync = connection.sync_connection if isinstance(connection, AsyncConnection) else connection
    if sync is None or sync.dialect.driver != "psycopg":
        return None
    return sync.connection.driver_connection


@contextmanager
def _without_preparing(driver: Any, pooled: bool) -> Iterator[None]:
    if not pooled:
        yield
        return
    threshold = driver.prepare_threshold
    driver.prepare_threshold = None
    try:
        yield
    finally:
        driver.prepare_threshold = threshold


def _remember(driver: Any, pid: int | None) -> bool:
    """Whether ``driver`` goes through a pooler, from the server process its probe named
    (None: the probe failed; unknown, so assumed pooled and not remembered: the statement
    itself then fails through SQLAlchemy)."""
    if pid is None:
        return True
    pooled: bool = pid != driver.info.backend_pid
    _POOLED[driver] = pooled
    return pooled


@contextmanager
def unprepared(connection: Connection) -> Iterator[None]:
    """Run the body without server-side prepared statements if ``connection`` goes through a
    pooler (see the module's docstring)."""
    driver = _driver(connection)
    if driver is None:
        yield
        return
    pooled = _POOLED.get(driver)
    if pooled is None:
        try:
            # Through the DBAPI cursor: under an AsyncConnection's greenlet bridge (run_sync)
            # the driver is psycopg's AsyncConnection, which this cursor awaits for us.
            dbapi: Any = connection.connection.dbapi_connection
            cursor = dbapi.cursor()
            try:
                cursor.execute(_BACKEND_PID)
                pid = cursor.fetchone()[0]
            finally:
                cursor.close()
        except psycopg.Error:
            pid = None
        pooled = _remember(driver, pid)
    with _without_preparing(driver, pooled):
        yield


@contextlib.asynccontextmanager
async def unprepared_async(connection: AsyncConnection) -> AsyncIterator[None]:
    """`unprepared` for an `AsyncConnection`."""
    driver = _driver(connection)
    if driver is None:
        yield
        return
    pooled = _POOLED.get(driver)
    if pooled is None:
        try:
            pid = (await (await driver.execute(_BACKEND_PID, prepare=False)).fetchone())[0]
        except psycopg.Error:
            pid = None
        pooled = _remember(driver, pid)
    with _without_preparing(driver, pooled):
        yield
