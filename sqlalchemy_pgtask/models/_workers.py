"""models._workers: worker registrations, their capabilities, and frozen handler policies."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from sqlalchemy_pgtask.models._base import NOW, RETRY_KINDS, Base, quoted, retry_shape_check
from sqlalchemy_pgtask.validation import CONCURRENCY_SCOPES


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
    started_at: Mapped[datetime] = mapped_column(server_default=NOW)
    heartbeat_at: Mapped[datetime] = mapped_column(server_default=NOW)
    expires_at: Mapped[datetime]
    #: The advisory lock ``(LOCK_NAMESPACE, lock_key)`` every connection the worker keeps
    #: holds in shared mode, gone with the last of them; None for a worker that holds none.
    lock_key: Mapped[int | None] = mapped_column(Integer)


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
        CheckConstraint(f"retry_kind IN ({quoted(RETRY_KINDS)})", name="retry_kind"),
        CheckConstraint(retry_shape_check(), name="retry_policy"),
        CheckConstraint("max_attempts IS NULL OR max_attempts > 0", name="max_attempts"),
        CheckConstraint(
            "concurrency_limit IS NULL OR concurrency_limit > 0", name="concurrency_limit"
        ),
        CheckConstraint(
            f"concurrency_scope IN ({quoted(CONCURRENCY_SCOPES)})", name="concurrency_scope"
        ),
    )

    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    retry_kind: Mapped[str] = mapped_column(Text)
    retry_base_seconds: Mapped[float | None] = mapped_column(Double)
    retry_factor: Mapped[float | None] = mapped_column(Double)
    retry_max_seconds: Mapped[float | None] = mapped_column(Double)
    retry_jitter: Mapped[bool] = mapped_column(Boolean)
    #: Applies to tasks enqueued without their own ``max_attempts``; NULL only for a policy
    #: frozen before this column existed, until a worker registers the identity again.
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)
    #: Holders allowed per concurrency key, for tasks enqueued with a key and no limit of
    #: their own; None: 1.
    concurrency_limit: Mapped[int | None] = mapped_column(Integer)
    #: ``workflow``: a durable suspension keeps the key; ``running``: only a running attempt.
    concurrency_scope: Mapped[str] = mapped_column(Text, server_default=text("'workflow'"))

