"""models: the one declarative definition of the pgtask schema; never creates or alters tables.

Every table lives in the PostgreSQL schema ``pgtask`` and belongs to `metadata`, which carries a
naming convention so constraint names are stable across the models and the Alembic revisions.
The shipped revisions (``sqlalchemy_pgtask/migrations``) install this schema; a drift test
applies them to an empty database and compares the result with these models. Install with
``alembic upgrade heads`` or ``pgtask migrate``, never with ``metadata.create_all``: the
triggers that keep invariants for every writer exist only in the revisions.

The mapped classes are ordinary SQLAlchemy models: query and join them from your own session.
Write to them only through the library's functions, which keep the state machine and the
fencing rules.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqlalchemy_pgtask.states import (
    ACTIVE_STATES,
    ATTEMPT_STATES,
    TASK_STATES,
    TERMINAL_STATES,
    AttemptState,
    TaskState,
)
from sqlalchemy_pgtask.validation import (
    ERROR_MAX_BYTES,
    HEADERS_MAX_BYTES,
    NAME_PATTERN,
    PAYLOAD_MAX_BYTES,
    QUEUE_NAME_MAX_BYTES,
    RESULT_MAX_BYTES,
    TASK_NAME_MAX_BYTES,
)

__all__ = [
    "ACTIVE_STATES",
    "ATTEMPT_STATES",
    "SCHEMA",
    "TASK_STATES",
    "TERMINAL_STATES",
    "Attempt",
    "Base",
    "CapacityRelease",
    "HandlerPolicy",
    "IdempotencyKey",
    "Queue",
    "Task",
    "WorkerCapability",
    "WorkerRecord",
    "metadata",
]

SCHEMA: Final = "pgtask"

RETRY_KINDS: Final = ("never", "fixed", "exponential")

metadata = MetaData(
    schema=SCHEMA,
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    },
)

_NOW: Final = text("statement_timestamp()")
_FAST_AUTOVACUUM: Final = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_analyze_threshold": "1000",
}
_TS = TIMESTAMP(timezone=True)


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def _name_check(column: str, max_bytes: int) -> str:
    return f"{column} ~ '{NAME_PATTERN}' AND octet_length({column}) <= {max_bytes}"


def _size_check(column: str, max_bytes: int) -> str:
    return f"octet_length({column}::text) <= {max_bytes}"


def _retry_shape_check(prefix: str = "retry_") -> str:
    """Legal retry-policy shapes; the same rule guards handler policies and task snapshots."""
    kind, base, factor, cap = (
        f"{prefix}kind", f"{prefix}base_seconds", f"{prefix}factor", f"{prefix}max_seconds",
    )
    return (
        f"({kind} IS NULL AND {base} IS NULL AND {factor} IS NULL AND {cap} IS NULL)"
        f" OR ({kind} = 'never' AND {base} IS NULL AND {factor} IS NULL AND {cap} IS NULL)"
        f" OR ({kind} = 'fixed' AND {base} >= 0 AND {factor} IS NULL AND {cap} IS NULL)"
        f" OR ({kind} = 'exponential' AND {base} >= 0 AND {factor} >= 1 AND {cap} >= {base})"
    )


class Base(DeclarativeBase):
    """Declarative base for the pgtask tables; separate from the application's own base."""

    metadata = metadata
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: _TS,
        uuid.UUID: UUID(as_uuid=True),
        dict[str, Any]: JSONB,
    }


class Queue(Base):
    """Settings of a named lane of work. A queue with no row uses the defaults below."""

    __tablename__ = "queues"
    __table_args__ = (
        CheckConstraint(_name_check("name", QUEUE_NAME_MAX_BYTES), name="name"),
        CheckConstraint("terminal_retention_seconds >= 0", name="terminal_retention"),
        CheckConstraint("idempotency_retention_seconds >= 0", name="idempotency_retention"),
        CheckConstraint(
            "max_outstanding_tasks IS NULL OR max_outstanding_tasks > 0", name="capacity"
        ),
        CheckConstraint("outstanding_tasks >= 0", name="outstanding_tasks"),
    )

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    #: How long succeeded, failed and cancelled tasks are kept before retention deletes them.
    terminal_retention_seconds: Mapped[int] = mapped_column(
        BigInteger, server_default=text("604800")
    )
    #: How long an idempotency key stays reserved after its task finished.
    idempotency_retention_seconds: Mapped[int] = mapped_column(
        BigInteger, server_default=text("2592000")
    )
    #: Capacity: the most pending + running + waiting tasks; NULL means unlimited.
    max_outstanding_tasks: Mapped[int | None] = mapped_column(BigInteger)
    #: Admission counter, maintained only while ``max_outstanding_tasks`` is set (recounted by
    #: a trigger when a limit is turned on). Finished tasks not yet folded in are in
    #: `CapacityRelease`: the exact count is this minus their sum.
    outstanding_tasks: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    #: A paused queue accepts enqueues and claims nothing.
    paused_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    updated_at: Mapped[datetime] = mapped_column(server_default=_NOW)


class Task(Base):
    """One unit of work and its current state (history of each claim is in `Attempt`)."""

    __tablename__ = "tasks"
    __table_args__ = (
        CheckConstraint(f"state IN ({_quoted(TASK_STATES)})", name="state"),
        CheckConstraint(_name_check("queue", QUEUE_NAME_MAX_BYTES), name="queue"),
        CheckConstraint(_name_check("name", TASK_NAME_MAX_BYTES), name="name"),
        CheckConstraint("version > 0", name="version"),
        CheckConstraint("attempt >= 0", name="attempt"),
        CheckConstraint("failed_attempts >= 0 AND failed_attempts <= attempt", name="failed"),
        CheckConstraint("max_attempts > 0", name="max_attempts"),
        # Unset until the first claim, which takes the registered handler's max_attempts.
        CheckConstraint("max_attempts IS NOT NULL OR attempt = 0", name="max_attempts_known"),
        CheckConstraint(
            "state <> 'running' OR (lease_token IS NOT NULL AND lease_owner IS NOT NULL"
            " AND lease_expires_at IS NOT NULL)",
            name="lease",
        ),
        CheckConstraint(
            f"(state IN ({_quoted(TERMINAL_STATES)})) = (completed_at IS NOT NULL)",
            name="completed_at",
        ),
        CheckConstraint("parent_id IS NULL OR parent_id <> id", name="parent"),
        CheckConstraint(_size_check("payload", PAYLOAD_MAX_BYTES), name="payload_size"),
        CheckConstraint(
            f"jsonb_typeof(headers) = 'object' AND {_size_check('headers', HEADERS_MAX_BYTES)}",
            name="headers",
        ),
        CheckConstraint(
            f"result IS NULL OR {_size_check('result', RESULT_MAX_BYTES)}", name="result_size"
        ),
        CheckConstraint(
            f"error IS NULL OR {_size_check('error', ERROR_MAX_BYTES)}", name="error_size"
        ),
        CheckConstraint(_retry_shape_check(), name="retry_policy"),
        # The claim path: due pending work of a queue, highest priority first.
        Index(
            "ix_tasks_claim",
            "queue", text("priority DESC"), "run_at", "id",
            postgresql_where=text("state = 'pending'"),
        ),
        # When the next scheduled task falls due, for an idle worker's sleep.
        Index(
            "ix_tasks_pending_run_at",
            "queue", "run_at",
            postgresql_where=text("state = 'pending'"),
        ),
        # Expired-lease recovery and lease renewal read only running rows.
        Index(
            "ix_tasks_lease_expiry",
            "lease_expires_at", "id",
            postgresql_where=text("state = 'running'"),
        ),
        # Outstanding work per queue: capacity recounts and the status command.
        Index(
            "ix_tasks_outstanding",
            "queue", "state",
            postgresql_where=text(f"state IN ({_quoted(ACTIVE_STATES)})"),
        ),
        # Finished tasks by queue and state: status counts and retention.
        Index(
            "ix_tasks_finished",
            "queue", "state", "completed_at",
            postgresql_where=text(f"state IN ({_quoted(TERMINAL_STATES)})"),
        ),
        Index(
            "ix_tasks_parent",
            "parent_id",
            postgresql_where=text("parent_id IS NOT NULL"),
        ),
        # Tasks churn fast; vacuum and analyze long before the 20% defaults.
        {"postgresql_with": _FAST_AUTOVACUUM},
    )

    id: Mapped[uuid.UUID] = mapped_column(
        primary_key=True, server_default=text("gen_random_uuid()")
    )
    queue: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    #: The handler version: a deploy can register a new version while old tasks drain.
    version: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    payload: Mapped[Any] = mapped_column(JSONB)
    headers: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    state: Mapped[TaskState] = mapped_column(Text, server_default=text("'pending'"))
    #: Higher runs first.
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    #: Earliest claim time, in database time.
    run_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    #: Number of claims so far, suspensions included; the attempt number of the current lease.
    attempt: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    #: Attempts that ended in failure; only these count against ``max_attempts``.
    failed_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    #: Failed attempts allowed; None until the first claim fills in the handler's default.
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    lease_token: Mapped[uuid.UUID | None]
    lease_owner: Mapped[uuid.UUID | None]
    lease_expires_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]
    #: A copy for display; uniqueness lives in `IdempotencyKey`, whose lifetime is its own.
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    result: Mapped[Any | None] = mapped_column(JSONB)
    error: Mapped[dict[str, Any] | None]
    parent_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("pgtask.tasks.id", ondelete="SET NULL")
    )
    retry_kind: Mapped[str | None] = mapped_column(Text)
    retry_base_seconds: Mapped[float | None] = mapped_column(Double)
    retry_factor: Mapped[float | None] = mapped_column(Double)
    retry_max_seconds: Mapped[float | None] = mapped_column(Double)
    retry_jitter: Mapped[bool | None] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    updated_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    completed_at: Mapped[datetime | None]


class Attempt(Base):
    """Append-only history: one row per claim of a task."""

    __tablename__ = "attempts"
    __table_args__ = (
        CheckConstraint(f"state IN ({_quoted(ATTEMPT_STATES)})", name="state"),
        CheckConstraint("attempt > 0", name="attempt"),
        CheckConstraint(
            f"error IS NULL OR {_size_check('error', ERROR_MAX_BYTES)}", name="error_size"
        ),
        # Grows by one row per claim and is updated once per outcome: keep its statistics
        # fresh, or plans made while it was small keep scanning it sequentially.
        {"postgresql_with": _FAST_AUTOVACUUM},
    )

    task_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("pgtask.tasks.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    lease_token: Mapped[uuid.UUID]
    worker_id: Mapped[uuid.UUID | None]
    state: Mapped[AttemptState] = mapped_column(Text, server_default=text("'running'"))
    started_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    finished_at: Mapped[datetime | None]
    error: Mapped[dict[str, Any] | None]


class IdempotencyKey(Base):
    """A deduplication reservation, deliberately independent of task history.

    ``task_id`` has no foreign key: deleting a task must not release its key. ``expires_at`` is
    NULL while the task is unfinished, and is set by triggers when it finishes or is deleted.
    """

    __tablename__ = "idempotency_keys"
    __table_args__ = (
        CheckConstraint("octet_length(key) BETWEEN 1 AND 512", name="key"),
        Index(
            "ix_idempotency_keys_expiry",
            "expires_at",
            postgresql_where=text("expires_at IS NOT NULL"),
        ),
    )

    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    task_id: Mapped[uuid.UUID]
    created_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    expires_at: Mapped[datetime | None]


class WorkerRecord(Base):
    """The registration of a worker process; live while ``expires_at`` is in the future."""

    __tablename__ = "workers"
    __table_args__ = (Index("ix_workers_expires_at", "expires_at"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    queues: Mapped[list[str]] = mapped_column(ARRAY(Text))
    #: The sqlalchemy-pgtask version the worker runs.
    version: Mapped[str] = mapped_column(Text)
    hostname: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    concurrency: Mapped[int] = mapped_column(Integer)
    draining: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    started_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    heartbeat_at: Mapped[datetime] = mapped_column(server_default=_NOW)
    expires_at: Mapped[datetime]


class WorkerCapability(Base):
    """A (queue, task name, version) a worker can run: capabilities are per queue."""

    __tablename__ = "worker_capabilities"

    worker_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("pgtask.workers.id", ondelete="CASCADE"), primary_key=True
    )
    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)


class HandlerPolicy(Base):
    """The retry policy and attempt budget of a handler identity, frozen by the first worker
    that registers it."""

    __tablename__ = "handler_policies"
    __table_args__ = (
        CheckConstraint(f"retry_kind IN ({_quoted(RETRY_KINDS)})", name="retry_kind"),
        CheckConstraint(_retry_shape_check(), name="retry_policy"),
        CheckConstraint("max_attempts > 0", name="max_attempts"),
    )

    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    retry_kind: Mapped[str] = mapped_column(Text)
    retry_base_seconds: Mapped[float | None] = mapped_column(Double)
    retry_factor: Mapped[float | None] = mapped_column(Double)
    retry_max_seconds: Mapped[float | None] = mapped_column(Double)
    retry_jitter: Mapped[bool] = mapped_column(Boolean)
    #: Applies to tasks enqueued without their own ``max_attempts``.
    max_attempts: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(server_default=_NOW)


class CapacityRelease(Base):
    """Room given back by a finished (or deleted) task of a capacity-limited queue.

    Appended by a trigger instead of decrementing ``queues.outstanding_tasks``, so finishing a
    task never waits for a producer that holds the queue row; admission folds these rows into
    the counter under the lock it takes anyway.
    """

    __tablename__ = "capacity_releases"
    __table_args__ = (
        CheckConstraint("released > 0", name="released"),
        Index("ix_capacity_releases_queue", "queue"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    queue: Mapped[str] = mapped_column(Text)
    released: Mapped[int] = mapped_column(Integer)

