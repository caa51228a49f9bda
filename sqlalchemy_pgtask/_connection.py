"""_connection: the seam between a caller's bind and the database; never commits, never flushes.

Every client function (enqueue, cancel, get_task, queue settings, the waiters) reaches
PostgreSQL through this module, so three things are decided once:

* **which connection**: the one of the caller's current transaction (`connection_of`), taken
  from a ``Session`` without flushing the caller's pending objects. The wrong kind of bind (an
  engine, or an async session given to a synchronous function) is a `TypeError` raised before
  any SQL, naming what to pass instead: accepting one would write nothing (an un-awaited
  coroutine), or run the statement and only then fail;
* **what a task id is** (`parse_task_id`), the names of the notification channels, and how
  to LISTEN on them (`listening_connection`: a connection of the caller's engine, so its
  ``connect_args``, ``creator`` and events apply);
* **how a statement runs on the caller's connection** (`translated_errors` given it): never
  prepared on the server behind a transaction pooler (`sqlalchemy_pgtask._prepared`), so
  every client function works behind PgBouncer in transaction mode;
* **what a database error means** to the caller (`translated_errors`): a driver error the
  library understands (capacity, a missing schema, an idempotency key hidden by the
  caller's snapshot) becomes its typed error, raised ``from`` the driver error; anything else
  passes through untouched.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
)
from sqlalchemy.orm import Session, scoped_session

from sqlalchemy_pgtask._asyncio import bounded, severing
from sqlalchemy_pgtask._failures import SERIALIZATION_FAILURE
from sqlalchemy_pgtask._prepared import unprepared
from sqlalchemy_pgtask.errors import (
    IdempotencyConflict,
    InvalidOptionError,
    PgTaskError,
    QueueFull,
    SchemaNotInstalled,
    TaskNotFound,
)
from sqlalchemy_pgtask.models import Task

__all__ = [
    "READY_CHANNEL",
    "RESULT_CHANNEL",
    "WAKE_ALL",
    "AsyncBind",
    "AsyncListener",
    "Listener",
    "SyncBind",
    "async_bind",
    "async_connection_of",
    "async_engine",
    "async_session",
    "connection_of",
    "listening_connection",
    "listening_connection_sync",
    "parse_task_id",
    "sync_bind",
    "sync_engine",
    "sync_session",
    "translated_errors",
]

#: ``NOTIFY`` channel of the enqueue trigger: due work may be waiting (a hint, never a promise).
READY_CHANNEL: Final = "pgtask_ready"
#: ``NOTIFY`` channel of the terminal-state trigger; the payload is the finished task's id.
RESULT_CHANNEL: Final = "pgtask_result"
#: A `READY_CHANNEL` payload that wakes every worker whatever its queues (sent when the
#: database clock is moved in tests).
WAKE_ALL: Final = "*"


#: What a synchronous client function runs in: the caller's session or connection. A
#: ``scoped_session`` stands for its current session.
SyncBind = Session | Connection | scoped_session[Any]
#: The asyncio twin of `SyncBind`.
AsyncBind = AsyncSession | AsyncConnection | async_scoped_session[Any]

# Executing through a Session would autoflush the caller's pending objects; the session's
# connection joins the same transaction without flushing anything.
_BIND_ARGUMENTS: Final = {"mapper": Task}

_SYNC_KINDS: Final = (Session, Connection, Engine, scoped_session)
_ASYNC_KINDS: Final = (AsyncSession, AsyncConnection, AsyncEngine, async_scoped_session)
_IN_TRANSACTION: Final = "inside your transaction"


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "AEIOU" else f"a {noun}"


def _wrong_kind(bind: object, function: str, *, is_async: bool, needs: str) -> TypeError:
    """The error for a bind of the wrong kind, saying what to pass instead."""
    called = f"{function}_async()" if is_async else f"{function}()"
    twin = f"{function}()" if is_async else f"{function}_async()"
    got = type(bind).__name__
    if isinstance(bind, _SYNC_KINDS if is_async else _ASYNC_KINDS):
        return TypeError(f"{called} needs {needs}; for {_a(got)} use {twin}")
    if isinstance(bind, (Engine, AsyncEngine)):
        begin = "async with engine.begin()" if is_async else "with engine.begin()"
        return TypeError(
            f"{called} needs {needs}, not {_a(got)}, which has no transaction to join: pass "
            f"your session, or the connection of `{begin} as connection:`"
        )
    return TypeError(f"{called} needs {needs}; got {_a(got)}")


def sync_bind(bind: object, function: str) -> Session | Connection:
    """``bind`` as the `Session` or `Connection` to run in; `TypeError` for any other kind."""
    if isinstance(bind, scoped_session):
        bind = bind()
    if isinstance(bind, (Session, Connection)):
        return bind
    raise _wrong_kind(
        bind, function, is_async=False, needs=f"a Session or Connection {_IN_TRANSACTION}"
    )


def async_bind(bind: object, function: str) -> AsyncSession | AsyncConnection:
    """`sync_bind` for the ``*_async`` functions."""
    if isinstance(bind, async_scoped_session):
        bind = bind()
    if isinstance(bind, (AsyncSession, AsyncConnection)):
        return bind
    raise _wrong_kind(
        bind, function, is_async=True, needs=f"an AsyncSession or AsyncConnection {_IN_TRANSACTION}"
    )


def sync_session(bind: object, function: str) -> Session:
    """``bind`` as a `Session`, for functions that return objects mapped in it."""
    if isinstance(bind, scoped_session):
        bind = bind()
    if isinstance(bind, Session):
        return bind
    raise _wrong_kind(bind, function, is_async=False, needs="a Session (it returns a mapped Task)")


def async_session(bind: object, function: str) -> AsyncSession:
    """`sync_session` for the ``*_async`` functions."""
    if isinstance(bind, async_scoped_session):
        bind = bind()
    if isinstance(bind, AsyncSession):
        return bind
    raise _wrong_kind(
        bind, function, is_async=True, needs="an AsyncSession (it returns a mapped Task)"
    )


def sync_engine(engine: object, function: str) -> Engine:
    """``engine`` as an `Engine`, for the waiters, which open connections of their own."""
    if isinstance(engine, Engine):
        return engine
    raise _wrong_kind(
        engine, function, is_async=False, needs="an Engine to open its own connections"
    )


def async_engine(engine: object, function: str) -> AsyncEngine:
    """`sync_engine` for the ``*_async`` waiters."""
    if isinstance(engine, AsyncEngine):
        return engine
    raise _wrong_kind(
        engine, function, is_async=True, needs="an AsyncEngine to open its own connections"
    )


def connection_of(bind: SyncBind, function: str = "connection_of") -> Connection:
    """The connection of ``bind``'s current transaction (begun if needed), without a flush."""
    target = sync_bind(bind, function)
    if isinstance(target, Session):
        return target.connection(bind_arguments=_BIND_ARGUMENTS)
    return target


async def async_connection_of(
    bind: AsyncBind, function: str = "async_connection_of"
) -> AsyncConnection:
    """`connection_of` for an `AsyncSession` or `AsyncConnection`."""
    target = async_bind(bind, function)
    if isinstance(target, AsyncSession):
        return await target.connection(bind_arguments=_BIND_ARGUMENTS)
    return target


def parse_task_id(value: object, field: str = "task_id") -> uuid.UUID:
    """A task id from a `uuid.UUID` or its text, so callers can pass ids from URLs and logs."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError as exc:
        raise InvalidOptionError(field, f"{value!r} is not a UUID") from exc


# Undefined table, schema or function: when the missing object is in schema pgtask, the
# schema is not installed (or not completely). Names appear in the message as the statement
# wrote them, schema-qualified: 'relation "pgtask.tasks" does not exist'.
_MISSING_OBJECT: Final = frozenset({"42P01", "3F000", "42883"})
_IN_PGTASK: Final = re.compile(r'(?<![\w$.])pgtask(?:\.|")')
#: Raised by the capacity recount trigger outside READ COMMITTED.
_CAPACITY_NEEDS_READ_COMMITTED: Final = "PT002"
_FOREIGN_KEY_VIOLATION: Final = "23503"
#: Foreign keys whose violation means "no such task" (a signal for an unknown task).
_TASK_REFERENCES: Final = frozenset({"fk_signals_task_id_tasks"})


def _translate(driver_error: BaseException | None, *, idempotent: bool) -> PgTaskError | None:
    """The library's error for a driver error it understands, or None to let it pass."""
    state = getattr(driver_error, "sqlstate", None)
    diag = getattr(driver_error, "diag", None)
    message = getattr(diag, "message_primary", None) or str(driver_error)
    if state == _CAPACITY_NEEDS_READ_COMMITTED:
        return InvalidOptionError("max_outstanding_tasks", message)
    if state == QueueFull.sqlstate:
        return QueueFull(message)
    if state in _MISSING_OBJECT and _IN_PGTASK.search(message):
        return SchemaNotInstalled(f"{SchemaNotInstalled()} The database said: {message}.")
    if (
        state == _FOREIGN_KEY_VIOLATION
        and getattr(diag, "constraint_name", None) in _TASK_REFERENCES
    ):
        return TaskNotFound(f"{TaskNotFound()} The database said: {message}.")
    if state == SERIALIZATION_FAILURE and idempotent:
        return IdempotencyConflict(f"{IdempotencyConflict()} The database said: {message}.")
    return None


@contextmanager
def translated_errors(
    connection: Connection | None = None, *, idempotent: bool = False
) -> Iterator[None]:
    """Run the body, raising the library's typed error for a database error it understands;
    with ``connection`` (the caller's), its statements are never prepared on the server if it
    goes through a transaction pooler (`sqlalchemy_pgtask._prepared.unprepared`).

    Used around every statement a client function runs, so each database error is translated
    once, at the boundary, with the driver error attached as ``__cause__``: PT001 is
    `QueueFull`; an undefined table, schema or function in schema ``pgtask`` is
    `SchemaNotInstalled`. With ``idempotent`` (the statement reserves idempotency keys), a
    serialization failure is `IdempotencyConflict`: under REPEATABLE READ or SERIALIZABLE,
    a key reserved by a transaction committed after this one's snapshot cannot be returned.
    """
    try:
        with contextlib.nullcontext() if connection is None else unprepared(connection):
            yield
    except DBAPIError as exc:
        translated = _translate(exc.orig, idempotent=idempotent)
        if translated is None:
            raise
        raise translated from exc
    except psycopg.Error as exc:  # the waiters' own LISTEN connection speaks psycopg directly
        translated = _translate(exc, idempotent=idempotent)
        if translated is None:
            raise
        raise translated from exc


async def _close(connection: Any) -> None:
    await connection.close()


class AsyncListener:
    """Notifications of a LISTEN connection (psycopg's, under the engine's pool connection)."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver

    async def payloads(self, timeout: float | None = None) -> AsyncIterator[str]:
        """Payloads as they arrive; with ``timeout``, stop after that many seconds."""
        async for notification in self._driver.notifies(timeout=timeout):
            yield str(notification.payload)

    async def ping(self) -> None:
        """One round trip on the listening connection (a silent one may be dead)."""
        await self._driver.execute("SELECT 1")

    @property
    def driver(self) -> Any:
        """The psycopg connection."""
        return self._driver


class Listener:
    """`AsyncListener` for a synchronous engine."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver

    def payloads(self, timeout: float | None = None) -> Iterator[str]:
        for notification in self._driver.notifies(timeout=timeout):
            yield str(notification.payload)


@contextlib.asynccontextmanager
async def listening_connection(
    engine: AsyncEngine, *channels: str, timeout: float, lock: tuple[int, int] | None = None
) -> AsyncIterator[AsyncListener]:
    """A connection of ``engine`` that LISTENs on ``channels`` (holding the advisory ``lock``
    in shared mode, if given, for as long as it is open).

    The connection comes from the engine, so its ``connect_args``, ``creator`` and events
    apply; it is invalidated afterwards instead of going back to the pool with a LISTEN on it
    (which also releases the lock). Connecting and subscribing each give up after ``timeout``
    seconds (`TimeoutError`).
    """
    connection = await bounded(engine.connect(), timeout, discard=_close)
    try:
        raw = await connection.get_raw_connection()
        driver: Any = raw.driver_connection  # psycopg.AsyncConnection
        # Severed, not cancelled, at the deadline: psycopg answers a cancellation with a
        # cancel request over the same (maybe dead) path, and waits for it.
        with severing(driver, timeout) as fired:
            try:
                await driver.set_autocommit(True)
                if lock is not None:
                    await driver.execute("SELECT pg_advisory_lock_shared(%s, %s)", lock)
                for channel in channels:
                    await driver.execute(f"LISTEN {channel}")
            except Exception as exc:
                if fired[0]:
                    raise TimeoutError(f"gave up after {timeout:g} s") from exc
                raise
        yield AsyncListener(driver)
    finally:
        with contextlib.suppress(Exception):
            await connection.invalidate()
        with contextlib.suppress(Exception):
            await connection.close()


@contextlib.contextmanager
def listening_connection_sync(engine: Engine, *channels: str) -> Iterator[Listener]:
    """`listening_connection` for a synchronous engine."""
    connection = engine.connect()
    try:
        driver: Any = connection.connection.driver_connection  # psycopg.Connection
        driver.autocommit = True
        for channel in channels:
            driver.execute(f"LISTEN {channel}")
        yield Listener(driver)
    finally:
        with contextlib.suppress(Exception):
            connection.invalidate()
        with contextlib.suppress(Exception):
            connection.close()
