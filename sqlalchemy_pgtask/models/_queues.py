"""models._queues: queue settings, capacity releases, and idempotency reservations."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Double,
    Identity,
    Index,
    Integer,
    Text,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from sqlalchemy_pgtask.models._base import NOW, Base, name_check, positive_duration_check
from sqlalchemy_pgtask.validation import (
    QUEUE_NAME_MAX_BYTES,
)


class Queue(Base):
    """Settings of a named lane of work. A queue with no row uses the defaults below."""

    __tablename__ = "queues"
    __table_args__ = (
        CheckConstraint(name_check("name", QUEUE_NAME_MAX_BYTES), name="name"),
        CheckConstraint("terminal_retention_seconds >= 0", name="terminal_retention"),
        CheckConstraint("idempotency_retention_seconds >= 0", name="idempotency_retention"),
        CheckConstraint(
            "max_outstanding_tasks IS NULL OR max_outstanding_tasks > 0", name="capacity"
        ),
        CheckConstraint("outstanding_tasks >= 0", name="outstanding_tasks"),
        CheckConstraint(
            "(rate_limit IS NULL) = (rate_period_seconds IS NULL)"
            " AND (rate_limit IS NULL OR rate_limit > 0)"
            " AND (rate_period_seconds IS NULL OR"
            f" {positive_duration_check('rate_period_seconds')})",
            name="rate_limit",
        ),
        CheckConstraint(
            f"starvation_timeout_seconds IS NULL"
            f" OR {positive_duration_check('starvation_timeout_seconds')}",
            name="starvation_timeout",
        ),
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
    #: Rate limit: at most this many task starts per ``rate_period_seconds``, across all
    #: workers (a token bucket in `RateBucket`); NULL (both) means unlimited.
    rate_limit: Mapped[int | None] = mapped_column(Integer)
    rate_period_seconds: Mapped[float | None] = mapped_column(Double)
    #: A pending task due for longer than this is claimed ahead of higher priorities.
    starvation_timeout_seconds: Mapped[float | None] = mapped_column(Double)
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)
    updated_at: Mapped[datetime] = mapped_column(server_default=NOW)


class IdempotencyKey(Base):
    """A deduplication reservation, deliberately independent of task history.

    ``task_id`` has no foreign key: deleting a task must not release its key. ``expires_at`` is
    NULL while the task exists (its expiry is derived from the task's completion time and the
    queue's idempotency retention), and is written down by a trigger when the task is deleted.
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
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)
    expires_at: Mapped[datetime | None]


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



class RateBucket(Base):
    """The token bucket of a rate-limited queue: claims take tokens, time refills them.

    Apart from `Queue` so a claim never waits for a producer holding the capacity counter.
    """

    __tablename__ = "rate_buckets"

    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    tokens: Mapped[float] = mapped_column(Double)
    refilled_at: Mapped[datetime]
