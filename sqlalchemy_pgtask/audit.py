"""audit: records administrative actions in ``pgtask.audit_log``, in the caller's transaction.

Every administrative change (retry, cancel, queue pause/resume/configure, schedule changes)
writes one entry in the same transaction as the change itself: the entry exists exactly when
the change committed, on an AUTOCOMMIT connection too (`sqlalchemy_pgtask._atomic`). The log
is append-only: a trigger refuses UPDATE, DELETE and TRUNCATE.
An entry names its actor; without one, the database role that made the change is recorded.
Nothing deletes entries: the log has no retention (see docs/admin.md).

`list_audit` reads the log, newest first, a page at a time.
"""

from __future__ import annotations

import typing
import uuid
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, Insert, Select, Table, func, insert, literal, select

from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    parse_task_id,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask.models import AuditEntry
from sqlalchemy_pgtask.models._operations import AUDIT_ACTIONS
from sqlalchemy_pgtask.validation import (
    check_free_text,
    check_int_range,
    check_queue_name,
    check_task_name,
)

__all__ = [
    "ACTOR_MAX_BYTES",
    "AUDITED_SETTINGS",
    "AUDIT_ACTIONS",
    "AUDIT_LIMIT_MAX",
    "REASON_MAX_BYTES",
    "AuditRecord",
    "audit_statement",
    "check_actor",
    "check_reason",
    "list_audit",
    "list_audit_async",
    "queue_entries",
]

ACTOR_MAX_BYTES: Final = 255
REASON_MAX_BYTES: Final = 1000


def check_actor(value: object) -> str | None:
    """None (the database role is recorded), or 1 to 255 bytes of text."""
    return None if value is None else check_free_text("actor", value, ACTOR_MAX_BYTES)


def check_reason(value: object) -> str | None:
    """None, or 1 to 1000 bytes of text."""
    return None if value is None else check_free_text("reason", value, REASON_MAX_BYTES)


def audit_statement(
    action: str,
    *,
    actor: str | None,
    reason: str | None = None,
    task_id: uuid.UUID | None = None,
    queue: str | None = None,
    schedule: str | None = None,
    details: dict[str, Any] | None = None,
) -> Insert:
    """The INSERT of one audit entry; ``actor`` and ``reason`` already checked."""
    if action not in AUDIT_ACTIONS:  # a programming error, not user input
        raise AssertionError(f"unknown audit action {action!r}")
    return insert(AuditEntry).values(
        actor=literal(actor) if actor is not None else func.current_user(),
        action=action,
        reason=reason,
        task_id=task_id,
        queue=queue,
        schedule=schedule,
        details=details,
    )


#: Queue settings whose changes ``queue.configure`` entries record (pausing has actions of
#: its own).
AUDITED_SETTINGS: Final = (
    "max_outstanding_tasks", "terminal_retention_seconds", "idempotency_retention_seconds",
    "rate_limit", "rate_period_seconds", "starvation_timeout_seconds",
)


def queue_entries(
    before: dict[str, Any] | None, after: dict[str, Any], written: set[str]
) -> list[tuple[str, dict[str, Any] | None]]:
    """The audit entries ``(action, details)`` of a queue change from ``before`` (None: the
    queue had no row) to ``after``, where ``written`` names the columns the change set.

    ``queue.pause`` / ``queue.resume`` when the pause changed (a resume says since when the
    queue was paused); ``queue.configure`` when a setting changed: ``{"changes": {setting:
    {"from": old, "to": new}}}``, or for a new row ``{"created": true, "settings": {...}}``
    with the settings given. Nothing when nothing changed.
    """
    entries: list[tuple[str, dict[str, Any] | None]] = []
    was_paused = None if before is None else before["paused_at"]
    if after["paused_at"] is not None and was_paused is None:
        entries.append(("queue.pause", None))
    elif after["paused_at"] is None and was_paused is not None:
        entries.append(("queue.resume", {"paused_since": was_paused.isoformat()}))
    if before is None:
        settings = {k: after[k] for k in AUDITED_SETTINGS if k in written}
        if settings:
            entries.append(("queue.configure", {"created": True, "settings": settings}))
    else:
        changes = {
            k: {"from": before[k], "to": after[k]}
            for k in AUDITED_SETTINGS
            if before[k] != after[k]
        }
        if changes:
            entries.append(("queue.configure", {"changes": changes}))
    return entries


# -- reading the log -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditRecord:
    """One entry of ``pgtask.audit_log``: who did what to which task, queue or schedule."""

    #: Increasing with each entry (an identity column): the key of `list_audit`'s pages.
    id: int
    #: When the change's statement ran (database time, ``pgtask.now()``).
    occurred_at: datetime
    #: Who asked for it: the ``actor`` passed, or the database role that made the change.
    actor: str
    #: What was done: one of `AUDIT_ACTIONS` (``"task.retry"``, ``"queue.pause"``, ...).
    action: str
    task_id: uuid.UUID | None
    queue: str | None
    schedule: str | None
    reason: str | None
    #: What changed, as JSON (the action's own fields; see docs/admin.md).
    details: dict[str, Any] | None


_RECORD_COLUMNS: Final = tuple(field.name for field in fields(AuditRecord))

#: The most entries one `list_audit` call returns.
AUDIT_LIMIT_MAX: Final = 10_000


def _audit_query(
    task_id: object, queue: object, schedule: object, limit: object, before_id: object
) -> Select[Any]:
    """The page's SELECT; raises `ValidationError` on bad filters, before any SQL."""
    log = typing.cast(Table, AuditEntry.__table__)
    most = check_int_range("limit", limit, 1, AUDIT_LIMIT_MAX)
    query = select(*(log.c[column] for column in _RECORD_COLUMNS))
    if task_id is not None:
        query = query.where(log.c.task_id == parse_task_id(task_id))
    if queue is not None:
        query = query.where(log.c.queue == check_queue_name(queue))
    if schedule is not None:
        query = query.where(log.c.schedule == check_task_name(schedule, "schedule"))
    if before_id is not None:
        query = query.where(log.c.id < check_int_range("before_id", before_id, 1, 2**63 - 1))
    return query.order_by(log.c.id.desc()).limit(most)


def _read(connection: Connection, query: Select[Any]) -> list[AuditRecord]:
    with translated_errors(connection):
        return [AuditRecord(**row) for row in connection.execute(query).mappings()]


def list_audit(
    bind: SyncBind,
    *,
    task_id: uuid.UUID | str | None = None,
    queue: str | None = None,
    schedule: str | None = None,
    limit: int = 100,
    before_id: int | None = None,
) -> list[AuditRecord]:
    """Audit entries, newest first, read in ``bind``'s transaction; never writes.

    Filters combine (all must match). Pages go by id: pass the last entry's ``id`` as
    ``before_id`` for the next, older page; entries written meanwhile never shift a page.

    :param limit: at most this many entries, 1 to 10,000.
    :raises ValidationError: a bad filter or limit, before any SQL.
    :raises SchemaNotInstalled: the database has no pgtask schema (or not this version).
    """
    target = sync_bind(bind, "list_audit")
    query = _audit_query(task_id, queue, schedule, limit, before_id)
    return _read(connection_of(target), query)


async def list_audit_async(
    bind: AsyncBind,
    *,
    task_id: uuid.UUID | str | None = None,
    queue: str | None = None,
    schedule: str | None = None,
    limit: int = 100,
    before_id: int | None = None,
) -> list[AuditRecord]:
    """`list_audit` for an `AsyncSession` or `AsyncConnection`."""
    target = async_bind(bind, "list_audit")
    query = _audit_query(task_id, queue, schedule, limit, before_id)
    connection = await async_connection_of(target)
    return await connection.run_sync(_read, query)
