"""queues: reads and changes queue settings inside the caller's transaction; never commits.

A queue needs no row to be used: a queue without one has the defaults (no capacity limit,
not paused, the default retention). `configure_queue` creates or changes the row, and
`list_queues` reads every row as a `QueueSettings`. Both run on the caller's session or
connection, so a settings change commits or rolls back with the caller's other work.

Turning a capacity limit on recounts the queue's outstanding tasks under a table lock (a
trigger does it, so every writer of the row gets it); `configure_queue` takes that lock before
the queue row, so that it never deadlocks with a producer waiting for the row
(`sqlalchemy_pgtask._queue_locks`). The count is exact only in a READ
COMMITTED transaction, whose statements each see the latest commits; under REPEATABLE READ or
SERIALIZABLE the count would come from the transaction's older snapshot and miss tasks
committed since, so it is refused there: here before any SQL, by the trigger for others.

Every change is written to the audit log in the same transaction (`sqlalchemy_pgtask.audit`):
``queue.pause`` and ``queue.resume`` when the pause changes, ``queue.configure`` with the
settings that changed. A call that changes nothing writes no entry.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Connection, Table, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from sqlalchemy_pgtask._atomic import audited_unit
from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask._queue_locks import locked_queue_row
from sqlalchemy_pgtask.audit import (
    AUDITED_SETTINGS,
    audit_statement,
    check_actor,
    check_reason,
    queue_entries,
)
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import CapacityRelease, Queue
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.validation import (
    DURATION_MAX_SECONDS,
    INT4_MAX,
    check_delay,
    check_int_range,
    check_queue_name,
    check_time_limit,
)

__all__ = [
    "UNSET",
    "QueueSettings",
    "configure_queue",
    "configure_queue_async",
    "list_queues",
    "list_queues_async",
]

#: Isolation levels whose statements each see the latest commits. PostgreSQL runs READ
#: UNCOMMITTED as READ COMMITTED.
_FRESH_SNAPSHOT_LEVELS: Final = frozenset({"READ COMMITTED", "READ UNCOMMITTED"})


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueSettings:
    """One row of ``pgtask.queues``: a queue's settings, as read in the caller's transaction."""

    name: str
    #: Capacity: the most pending + running + waiting tasks; None means unlimited.
    max_outstanding_tasks: int | None
    #: Outstanding tasks as the admission counter sees them (counted only while a limit is set).
    outstanding_tasks: int
    #: Since when the queue is paused (it accepts enqueues, nothing is claimed); None: active.
    paused_at: datetime | None
    terminal_retention_seconds: int
    idempotency_retention_seconds: int
    #: Rate limit: at most this many task starts per ``rate_period_seconds``, across all
    #: workers; None (both) means unlimited.
    rate_limit: int | None
    rate_period_seconds: float | None
    #: A pending task due for longer than this many seconds is claimed ahead of higher
    #: priorities; None: priority alone orders the queue.
    starvation_timeout_seconds: float | None
    created_at: datetime
    updated_at: datetime

    @property
    def paused(self) -> bool:
        """Whether workers leave this queue's tasks alone."""
        return self.paused_at is not None


_COLUMNS: Final = tuple(field.name for field in fields(QueueSettings))


class _Unset:
    """Marks an option the caller did not pass (None is a meaningful value)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()

#: The rate period when a rate limit is given without one: per second.
DEFAULT_RATE_PERIOD: Final = 1.0
#: The shortest rate period: the token refill (elapsed * limit / period) overflows a double
#: for periods near 1e-300 s, which failed every claim of the worker with a DataError.
RATE_PERIOD_MIN: Final = 0.001


def _rate_period(value: object) -> float:
    if value is None:
        raise InvalidOptionError(
            "rate_period", "must be a positive number of seconds or a timedelta, got None"
        )
    seconds = check_delay("rate_period", value)
    if seconds < RATE_PERIOD_MIN:
        raise InvalidOptionError(
            "rate_period", f"must be at least {RATE_PERIOD_MIN} s (a millisecond), got {value!r}"
        )
    return seconds


def _rate_changes(rate_limit: object, rate_period: object) -> dict[str, Any]:
    """The rate-limit columns to write; both or neither are set (a CHECK says so too)."""
    if isinstance(rate_limit, _Unset):
        if not isinstance(rate_period, _Unset):
            raise InvalidOptionError(
                "rate_period", "needs rate_limit: pass both to change the period"
            )
        return {}
    if rate_limit is None:
        if not isinstance(rate_period, _Unset):
            raise InvalidOptionError(
                "rate_period", "must not be given with rate_limit=None (no rate limit)"
            )
        return {"rate_limit": None, "rate_period_seconds": None}
    check_int_range("rate_limit", rate_limit, 1, INT4_MAX)
    period = DEFAULT_RATE_PERIOD if isinstance(rate_period, _Unset) else _rate_period(rate_period)
    return {"rate_limit": rate_limit, "rate_period_seconds": period}


def _changes(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The validated column values to write; raises `ValidationError` before any SQL.

    ``options`` holds every option of `configure_queue`, `UNSET` where not passed.
    """
    check_queue_name(name)
    values: dict[str, Any] = {}
    capacity = options["max_outstanding_tasks"]
    if not isinstance(capacity, _Unset):
        if capacity is not None:
            check_int_range("max_outstanding_tasks", capacity, 1, 2**63 - 1)
        values["max_outstanding_tasks"] = capacity
    for option in ("terminal_retention_seconds", "idempotency_retention_seconds"):
        value = options[option]
        if not isinstance(value, _Unset):
            # Bounded so completed_at + make_interval(secs => ...) in the key-expiry trigger
            # and retention cannot overflow when a task finishes, long after this call.
            values[option] = check_int_range(option, value, 0, DURATION_MAX_SECONDS)
    values.update(_rate_changes(options["rate_limit"], options["rate_period"]))
    starvation = options["starvation_timeout"]
    if not isinstance(starvation, _Unset):
        values["starvation_timeout_seconds"] = check_time_limit("starvation_timeout", starvation)
    paused = options["paused"]
    if not isinstance(paused, _Unset):
        if not isinstance(paused, bool):
            raise InvalidOptionError("paused", "must be a bool")
        values["paused_at"] = func.coalesce(Queue.paused_at, NOW) if paused else None
    return values


def _check_isolation(connection: Connection, values: dict[str, Any]) -> None:
    """Refuse a capacity limit where its recount would read a stale snapshot."""
    if values.get("max_outstanding_tasks") is None:
        return
    # Reads the transaction's actual level (what SET TRANSACTION or the engine chose) with a
    # SHOW on the driver connection; none of this function's statements has run yet.
    level = connection.get_isolation_level()
    if level not in _FRESH_SNAPSHOT_LEVELS:
        raise InvalidOptionError(
            "max_outstanding_tasks",
            f"a capacity limit recounts the queue's outstanding tasks, which is exact only in"
            f" a READ COMMITTED transaction; this one is {level}, whose snapshot may miss"
            f" tasks committed since it began: set the limit in a READ COMMITTED transaction",
        )


def _configure(
    connection: Connection,
    name: str,
    values: dict[str, Any],
    actor: str | None,
    reason: str | None,
) -> dict[str, Any]:
    queues = typing.cast(Table, Queue.__table__)
    # Locked, so the audit's "from" values are the ones this change replaces.
    locked = (
        select(*(queues.c[k] for k in (*AUDITED_SETTINGS, "paused_at")))
        .where(queues.c.name == name)
        .with_for_update(key_share=True)  # FOR NO KEY UPDATE
    )
    # The isolation's SHOW, too, unprepared behind a pooler, and inside the unit: on an
    # AUTOCOMMIT connection the check then reads the level of the unit's own transaction.
    with audited_unit(connection), translated_errors(connection):
        _check_isolation(connection, values)
        before = None
        if values:
            before = locked_queue_row(
                connection, name, locked, values.get("max_outstanding_tasks") is not None
            )
            if before is None:
                # No row to lock: create it first, so that two callers creating one queue
                # take turns on its row, and the second audits against what the first wrote
                # (both used to write a "created" entry, the second changing nothing).
                created = connection.execute(
                    pg_insert(queues).values(name=name)
                    .on_conflict_do_nothing(index_elements=[queues.c.name])
                    .returning(queues.c.name)
                ).first()
                if created is None:
                    before = connection.execute(locked).mappings().one()
        row = _write(connection, name, values)
        for action, details in queue_entries(
            None if before is None else dict(before), row, set(values)
        ):
            connection.execute(
                audit_statement(action, actor=actor, reason=reason, queue=name, details=details)
            )
        return row


def _settings_columns() -> list[Any]:
    """The queue's columns, with ``outstanding_tasks`` net of releases not yet folded in."""
    queues = typing.cast(Table, Queue.__table__)
    released = (
        select(func.coalesce(func.sum(CapacityRelease.released), 0))
        .where(CapacityRelease.queue == queues.c.name)
        .scalar_subquery()
    )
    # Never below 0: a task that finished while its queue's limit was being removed leaves a
    # release behind the reset counter (the next limit's recount deletes it).
    return [
        func.greatest(queues.c.outstanding_tasks - released, 0).label(column)
        if column == "outstanding_tasks"
        else queues.c[column]
        for column in _COLUMNS
    ]


def _write(connection: Connection, name: str, values: dict[str, Any]) -> dict[str, Any]:
    # The capacity counter is the database's business: a trigger recounts the outstanding
    # tasks whenever a limit is turned on, whoever writes the row (an ORM session.add too).
    # With values, `_configure` has made sure the row exists (and locked it).
    queues = typing.cast(Table, Queue.__table__)
    if values:
        connection.execute(
            update(queues).where(queues.c.name == name).values(**values, updated_at=NOW)
        )
    else:
        connection.execute(
            pg_insert(queues).values(name=name).on_conflict_do_nothing(
                index_elements=[queues.c.name]
            )
        )
    row = connection.execute(
        select(*_settings_columns()).where(queues.c.name == name)
    ).mappings().one()
    return dict(row)


Seconds = float | timedelta


def configure_queue(
    bind: SyncBind,
    name: str,
    *,
    max_outstanding_tasks: int | _Unset | None = UNSET,
    terminal_retention_seconds: int | _Unset = UNSET,
    idempotency_retention_seconds: int | _Unset = UNSET,
    paused: bool | _Unset = UNSET,
    rate_limit: int | _Unset | None = UNSET,
    rate_period: Seconds | _Unset = UNSET,
    starvation_timeout: Seconds | _Unset | None = UNSET,
    actor: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """Create or change a queue's settings in ``bind``'s transaction; returns its row.

    Only the options passed change. ``max_outstanding_tasks=None`` removes the capacity limit.
    Retention settings are whole seconds from 0 to 100 years (`DURATION_MAX_SECONDS`).
    Turning a limit on recounts the queue's outstanding tasks; to count exactly it briefly
    takes a lock on ``pgtask.tasks`` that waits for in-flight writes and blocks new ones until
    the caller commits, so commit promptly. A paused queue accepts enqueues but nothing is
    claimed from it until it is resumed.

    ``rate_limit`` starts per ``rate_period`` (seconds or a `timedelta`; 1 second when only
    ``rate_limit`` is given) across all workers; ``rate_limit=None`` removes the limit. The
    period cannot be changed alone: pass the limit with it. ``starvation_timeout`` (seconds or
    a `timedelta`; None removes it): a pending task due for longer than that is claimed ahead
    of higher priorities.

    The change is audited in the same transaction (``queue.pause``, ``queue.resume``,
    ``queue.configure`` with the changed settings) as done by ``actor`` (default: the
    database role) for ``reason``. Never commits.

    :raises ValidationError: a bad option, actor or reason, before any SQL; also
        (`InvalidOptionError` on ``max_outstanding_tasks``) a limit set in a transaction that
        is not READ COMMITTED.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    """
    target = sync_bind(bind, "configure_queue")
    values = _changes(name, {
        "max_outstanding_tasks": max_outstanding_tasks, "paused": paused,
        "terminal_retention_seconds": terminal_retention_seconds,
        "idempotency_retention_seconds": idempotency_retention_seconds,
        "rate_limit": rate_limit, "rate_period": rate_period,
        "starvation_timeout": starvation_timeout,
    })
    actor, reason = check_actor(actor), check_reason(reason)
    return _configure(connection_of(target), name, values, actor, reason)


async def configure_queue_async(
    bind: AsyncBind,
    name: str,
    *,
    max_outstanding_tasks: int | _Unset | None = UNSET,
    terminal_retention_seconds: int | _Unset = UNSET,
    idempotency_retention_seconds: int | _Unset = UNSET,
    paused: bool | _Unset = UNSET,
    rate_limit: int | _Unset | None = UNSET,
    rate_period: Seconds | _Unset = UNSET,
    starvation_timeout: Seconds | _Unset | None = UNSET,
    actor: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """`configure_queue` for an `AsyncSession` or `AsyncConnection`; the same guarantees."""
    target = async_bind(bind, "configure_queue")
    values = _changes(name, {
        "max_outstanding_tasks": max_outstanding_tasks, "paused": paused,
        "terminal_retention_seconds": terminal_retention_seconds,
        "idempotency_retention_seconds": idempotency_retention_seconds,
        "rate_limit": rate_limit, "rate_period": rate_period,
        "starvation_timeout": starvation_timeout,
    })
    actor, reason = check_actor(actor), check_reason(reason)
    connection = await async_connection_of(target)
    return await connection.run_sync(_configure, name, values, actor, reason)


def set_paused(
    connection: Connection, name: str, paused: bool, actor: str | None, reason: str | None
) -> QueueSettings:
    """Pause or resume ``name`` (checked) and audit it; for `sqlalchemy_pgtask.admin`."""
    values = {"paused_at": func.coalesce(Queue.paused_at, NOW) if paused else None}
    return QueueSettings(**_configure(connection, name, values, actor, reason))


def _read(connection: Connection) -> list[QueueSettings]:
    with translated_errors(connection):
        rows = connection.execute(
            select(*_settings_columns()).order_by(Queue.name)
        ).mappings()
        return [QueueSettings(**row) for row in rows]


def list_queues(bind: SyncBind) -> list[QueueSettings]:
    """Every queue that has settings, by name, read in ``bind``'s transaction.

    Queues without a row use the defaults and are not listed.
    """
    return _read(connection_of(sync_bind(bind, "list_queues")))


async def list_queues_async(bind: AsyncBind) -> list[QueueSettings]:
    """`list_queues` for an `AsyncSession` or `AsyncConnection`."""
    connection = await async_connection_of(async_bind(bind, "list_queues"))
    return await connection.run_sync(_read)
