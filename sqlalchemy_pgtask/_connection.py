"""_connection: the seam between a caller's bind and the database; never commits, never flushes.

Every client function (enqueue, cancel, get_task, queue settings, the waiters) reaches
PostgreSQL through this module, so three things are decided once:

* **which connection**: the one of the caller's current transaction (`connection_of`), taken
  from a ``Session`` without flushing the caller's pending objects;
* **what a task id is** (`parse_task_id`) and the names of the notification channels;
* **what a database error means** to the caller (`translated_errors`): a driver error the
  library understands becomes its typed error, raised ``from`` the driver error; anything else
  passes through untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask.errors import InvalidOptionError, PgTaskError, QueueFull
from sqlalchemy_pgtask.models import Task

__all__ = [
    "READY_CHANNEL",
    "RESULT_CHANNEL",
    "AsyncBind",
    "SyncBind",
    "async_connection_of",
    "connection_of",
    "parse_task_id",
    "translated_errors",
]

#: ``NOTIFY`` channel of the enqueue trigger: due work may be waiting (a hint, never a promise).
READY_CHANNEL: Final = "pgtask_ready"
#: ``NOTIFY`` channel of the terminal-state trigger; the payload is the finished task's id.
RESULT_CHANNEL: Final = "pgtask_result"

SyncBind = Session | Connection
AsyncBind = AsyncSession | AsyncConnection

# Executing through a Session would autoflush the caller's pending objects; the session's
# connection joins the same transaction without flushing anything.
_BIND_ARGUMENTS: Final = {"mapper": Task}


def connection_of(bind: SyncBind) -> Connection:
    """The connection of ``bind``'s current transaction (begun if needed), without a flush."""
    if isinstance(bind, Session):
        return bind.connection(bind_arguments=_BIND_ARGUMENTS)
    return bind


async def async_connection_of(bind: AsyncBind) -> AsyncConnection:
    """`connection_of` for an `AsyncSession` or `AsyncConnection`."""
    if isinstance(bind, AsyncSession):
        return await bind.connection(bind_arguments=_BIND_ARGUMENTS)
    return bind


def parse_task_id(value: object, field: str = "task_id") -> uuid.UUID:
    """A task id from a `uuid.UUID` or its text, so callers can pass ids from URLs and logs."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError as exc:
        raise InvalidOptionError(field, f"{value!r} is not a UUID") from exc


def _translate(driver_error: BaseException | None) -> PgTaskError | None:
    """The library's error for a driver error it understands, or None to let it pass."""
    state = getattr(driver_error, "sqlstate", None)
    diag = getattr(driver_error, "diag", None)
    message = getattr(diag, "message_primary", None) or str(driver_error)
    if state == QueueFull.sqlstate:
        return QueueFull(message)
    return None


@contextmanager
def translated_errors() -> Iterator[None]:
    """Run the body, raising the library's typed error for a database error it understands.

    Used around every statement a client function runs, so each database error is translated
    once, at the boundary, with the driver error attached as ``__cause__``.
    """
    try:
        yield
    except DBAPIError as exc:
        translated = _translate(exc.orig)
        if translated is None:
            raise
        raise translated from exc
    except psycopg.Error as exc:  # the waiters' own LISTEN connection speaks psycopg directly
        translated = _translate(exc)
        if translated is None:
            raise
        raise translated from exc
