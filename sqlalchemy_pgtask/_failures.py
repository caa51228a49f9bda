"""_failures: which database failures are worth retrying, and how long to wait before it.

Shared by the worker's loops (``worker._reconnect``), the scheduler's materialiser and the
result waiters' listener; it imports nothing of the package, so any module may use it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import psycopg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

__all__ = [
    "HELD_BACK", "SERIALIZATION_FAILURE", "Backoff", "brief", "held_back",
    "is_serialization_failure", "is_transient",
]


class Backoff:
    """Bounded exponential backoff with full jitter."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self._base = base
        self._cap = cap
        self._failures = 0

    def reset(self) -> None:
        self._failures = 0

    def next(self) -> float:
        ceiling = min(self._cap, self._base * 2**self._failures)
        self._failures = min(self._failures + 1, 32)
        return random.uniform(ceiling / 2, ceiling)  # noqa: S311 - spread, not secrecy


def brief(exc: BaseException) -> str:
    """One line about a failure, without the statement and its parameters (task data)."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


#: A transaction that keeps one snapshot (REPEATABLE READ or SERIALIZABLE) met a row changed
#: since: the whole transaction must be retried.
SERIALIZATION_FAILURE: Final = "40001"


def is_serialization_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (SQLAlchemy's wrapper or the driver's own error) is a serialization
    failure."""
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return getattr(cause, "sqlstate", None) == SERIALIZATION_FAILURE


#: SQLSTATE -> reason of a statement stopped by what one of its rows needed, which says
#: nothing about the other rows (the batch passes, retention and the scheduler then go on one
#: at a time, or set that one aside): a lock another transaction holds past ``NOWAIT`` or
#: ``lock_timeout`` (55P03), ``statement_timeout`` (57014), a deadlock PostgreSQL broke
#: (40P01), a serialization failure (40001).
HELD_BACK: Final[Mapping[str, str]] = MappingProxyType({
    "55P03": "lock_not_available", "57014": "statement_timeout", "40P01": "deadlock_detected",
    SERIALIZATION_FAILURE: "serialization_failure",
})


def held_back(exc: BaseException) -> str | None:
    """The `HELD_BACK` reason of ``exc`` (SQLAlchemy's wrapper or the driver's own error), or
    None for any other failure."""
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return HELD_BACK.get(getattr(cause, "sqlstate", None) or "")


#: SQLSTATEs worth retrying that psycopg does not raise as ``OperationalError``: a server
#: that is read-only for now (a standby, or an old primary after a failover) and the
#: recovery-time and shutdown classes.
_TRANSIENT_SQLSTATES: Final = frozenset({"25006", "57P01", "57P02", "57P03", "53300"})


def is_transient(exc: BaseException) -> bool:
    """Retry after backoff? A lost connection also means a transaction's outcome is unknown.

    psycopg's ``OperationalError`` covers connection loss, ``lock_timeout`` and
    ``statement_timeout`` (``QueryCanceled``), serialisation failures and deadlocks.
    """
    if isinstance(exc, DBAPIError):
        return (
            bool(exc.connection_invalidated)
            or isinstance(exc.orig, (psycopg.OperationalError, psycopg.InterfaceError))
            or getattr(exc.orig, "sqlstate", None) in _TRANSIENT_SQLSTATES
        )
    if getattr(exc, "sqlstate", None) in _TRANSIENT_SQLSTATES:
        return True
    return isinstance(
        exc, (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout, OSError, TimeoutError)
    )
