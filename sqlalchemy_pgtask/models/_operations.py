"""models._operations: recurring schedules and the append-only audit log."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    Identity,
    Index,
    Integer,
    SmallInteger,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from sqlalchemy_pgtask.models._base import (
    NOW,
    Base,
    concurrency_key_check,
    concurrency_limit_check,
    name_check,
    positive_duration_check,
    quoted,
    size_check,
)
from sqlalchemy_pgtask.validation import (
    DURATION_MAX_SECONDS,
    HEADERS_MAX_BYTES,
    PAYLOAD_MAX_BYTES,
    QUEUE_NAME_MAX_BYTES,
    TASK_NAME_MAX_BYTES,
)

__all__ = ["AUDIT_ACTIONS", "MISFIRE_POLICIES", "OVERLAP_POLICIES", "AuditEntry", "Schedule"]

#: What happens to occurrences missed while no worker ran (see docs/schedules.md).
MISFIRE_POLICIES: Final = ("skip", "latest", "catch_up")
#: Whether an occurrence starts while the previous one is still unfinished.
OVERLAP_POLICIES: Final = ("allow", "skip")
#: Every administrative action the audit log records.
AUDIT_ACTIONS: Final = (
    "task.retry", "task.cancel", "queue.pause", "queue.resume", "queue.configure",
    "schedule.set", "schedule.pause", "schedule.resume", "schedule.delete", "schedule.run_now",
)
#: Most occurrences one catch-up may materialise.
CATCH_UP_MAX: Final = 10_000


class Schedule(Base):
    """A recurring task: a cron expression or a fixed interval, and the task to enqueue.

    ``next_run_at`` is the cursor: the next occurrence not yet materialised. Whoever
    materialises an occurrence inserts its task and advances the cursor in one transaction.
    """

    __tablename__ = "schedules"
    __table_args__ = (
        CheckConstraint(name_check("name", TASK_NAME_MAX_BYTES), name="name"),
        CheckConstraint("(cron IS NULL) <> (interval_seconds IS NULL)", name="kind"),
        CheckConstraint("cron IS NULL OR octet_length(cron) BETWEEN 1 AND 255", name="cron"),
        CheckConstraint(
            "interval_seconds IS NULL"
            f" OR (interval_seconds >= 1 AND interval_seconds <= {DURATION_MAX_SECONDS})",
            name="interval",
        ),
        CheckConstraint("octet_length(timezone) BETWEEN 1 AND 64", name="timezone"),
        CheckConstraint(f"misfire IN ({quoted(MISFIRE_POLICIES)})", name="misfire"),
        CheckConstraint(
            "(misfire = 'catch_up') = (catch_up_limit IS NOT NULL)"
            f" AND (catch_up_limit IS NULL OR catch_up_limit BETWEEN 1 AND {CATCH_UP_MAX})",
            name="catch_up",
        ),
        CheckConstraint(f"overlap IN ({quoted(OVERLAP_POLICIES)})", name="overlap"),
        CheckConstraint(name_check("queue", QUEUE_NAME_MAX_BYTES), name="queue"),
        CheckConstraint(name_check("task_name", TASK_NAME_MAX_BYTES), name="task_name"),
        CheckConstraint("version > 0", name="version"),
        CheckConstraint(size_check("payload", PAYLOAD_MAX_BYTES), name="payload_size"),
        CheckConstraint(
            f"jsonb_typeof(headers) = 'object' AND {size_check('headers', HEADERS_MAX_BYTES)}",
            name="headers",
        ),
        CheckConstraint("max_attempts IS NULL OR max_attempts > 0", name="max_attempts"),
        CheckConstraint(
            f"timeout_seconds IS NULL OR {positive_duration_check('timeout_seconds')}",
            name="timeout",
        ),
        CheckConstraint(concurrency_key_check(), name="concurrency_key"),
        CheckConstraint(concurrency_limit_check(), name="concurrency_limit"),
        # Due schedules, earliest first, for the materialisers.
        Index("ix_schedules_due", "next_run_at", postgresql_where=text("paused_at IS NULL")),
    )

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    #: A cron expression (5 fields, or 6 with seconds first); or None for an interval.
    cron: Mapped[str | None] = mapped_column(Text)
    interval_seconds: Mapped[float | None] = mapped_column(Double)
    #: IANA time zone the cron expression is read in.
    timezone: Mapped[str] = mapped_column(Text, server_default=text("'UTC'"))
    misfire: Mapped[str] = mapped_column(Text, server_default=text("'latest'"))
    catch_up_limit: Mapped[int | None] = mapped_column(Integer)
    overlap: Mapped[str] = mapped_column(Text, server_default=text("'allow'"))
    queue: Mapped[str] = mapped_column(Text)
    task_name: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    payload: Mapped[Any] = mapped_column(JSONB, server_default=text("'null'::jsonb"))
    headers: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    timeout_seconds: Mapped[float | None] = mapped_column(Double)
    #: Declared in code (reconciled at worker start) rather than managed by API or CLI.
    declared: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    #: The cursor: the next occurrence to materialise (database time).
    next_run_at: Mapped[datetime]
    #: The task of the latest materialised occurrence (for the overlap policy).
    last_task_id: Mapped[uuid.UUID | None]
    #: Why the latest materialisation failed, if it did; cleared by the next success.
    last_error: Mapped[str | None] = mapped_column(Text)
    paused_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)
    updated_at: Mapped[datetime] = mapped_column(server_default=NOW)
    #: The concurrency key and limit of every occurrence (docs/concurrency.md).
    concurrency_key: Mapped[str | None] = mapped_column(Text)
    concurrency_limit: Mapped[int | None] = mapped_column(Integer)


class AuditEntry(Base):
    """One administrative action; append-only (a trigger refuses UPDATE, DELETE, TRUNCATE).

    No foreign keys: an entry outlives the task, queue or schedule it names.
    """

    __tablename__ = "audit_log"
    __table_args__ = (
        CheckConstraint("octet_length(actor) BETWEEN 1 AND 255", name="actor"),
        CheckConstraint(f"action IN ({quoted(AUDIT_ACTIONS)})", name="action"),
        CheckConstraint("reason IS NULL OR octet_length(reason) <= 1000", name="reason"),
        CheckConstraint(f"details IS NULL OR {size_check('details', 65536)}", name="details_size"),
        Index("ix_audit_log_task_id", "task_id", postgresql_where=text("task_id IS NOT NULL")),
        Index("ix_audit_log_occurred_at", "occurred_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    occurred_at: Mapped[datetime] = mapped_column(server_default=NOW)
    actor: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    task_id: Mapped[uuid.UUID | None]
    queue: Mapped[str | None] = mapped_column(Text)
    schedule: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None]
