"""status: read-only views of workers and queues for operators; never writes.

The one question these answer that the tables alone do not: is there pending work that no
live worker can run (an unknown task name or handler version, or no worker on the queue)?
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, and_, exists, func, select

from sqlalchemy_pgtask.models import ACTIVE_STATES, Task, WorkerCapability, WorkerRecord

__all__ = ["QueueCounts", "Unroutable", "WorkerInfo", "live_workers", "queue_counts", "unroutable"]


@dataclass(frozen=True)
class WorkerInfo:
    id: uuid.UUID
    hostname: str
    pid: int
    queues: list[str]
    version: str
    concurrency: int
    draining: bool
    started_at: datetime
    heartbeat_age_seconds: float


@dataclass(frozen=True)
class QueueCounts:
    queue: str
    pending: int
    due: int
    running: int
    waiting: int


@dataclass(frozen=True)
class Unroutable:
    """Pending tasks of one identity that no live, non-draining worker has registered."""

    queue: str
    name: str
    version: int
    count: int


def live_workers(connection: Connection) -> list[WorkerInfo]:
    """Workers whose heartbeat has not expired, newest first."""
    now = func.statement_timestamp()
    rows = connection.execute(
        select(
            WorkerRecord.id, WorkerRecord.hostname, WorkerRecord.pid, WorkerRecord.queues,
            WorkerRecord.version, WorkerRecord.concurrency, WorkerRecord.draining,
            WorkerRecord.started_at,
            func.extract("epoch", now - WorkerRecord.heartbeat_at).label("age"),
        )
        .where(WorkerRecord.expires_at > now)
        .order_by(WorkerRecord.started_at.desc())
    ).all()
    return [
        WorkerInfo(
            id=r.id, hostname=r.hostname, pid=r.pid, queues=list(r.queues), version=r.version,
            concurrency=r.concurrency, draining=r.draining, started_at=r.started_at,
            heartbeat_age_seconds=float(r.age),
        )
        for r in rows
    ]


def queue_counts(connection: Connection) -> list[QueueCounts]:
    """Outstanding tasks per queue (served by the partial outstanding index)."""
    now = func.statement_timestamp()
    rows = connection.execute(
        select(
            Task.queue,
            func.count().filter(Task.state == "pending").label("pending"),
            func.count().filter(Task.state == "pending", Task.run_at <= now).label("due"),
            func.count().filter(Task.state == "running").label("running"),
            func.count().filter(Task.state == "waiting").label("waiting"),
        )
        .where(Task.state.in_(ACTIVE_STATES))
        .group_by(Task.queue)
        .order_by(Task.queue)
    ).all()
    return [QueueCounts(r.queue, r.pending, r.due, r.running, r.waiting) for r in rows]


def unroutable(connection: Connection) -> list[Unroutable]:
    """Pending task identities that no live, non-draining worker can claim."""
    now = func.statement_timestamp()
    capable = exists().where(
        WorkerCapability.worker_id == WorkerRecord.id,
        WorkerRecord.expires_at > now,
        WorkerRecord.draining.is_(False),
        and_(
            WorkerCapability.queue == Task.queue,
            WorkerCapability.name == Task.name,
            WorkerCapability.version == Task.version,
        ),
    )
    rows = connection.execute(
        select(Task.queue, Task.name, Task.version, func.count().label("count"))
        .where(Task.state == "pending", ~capable)
        .group_by(Task.queue, Task.name, Task.version)
        .order_by(Task.queue, Task.name, Task.version)
    ).all()
    return [Unroutable(r.queue, r.name, r.version, r[3]) for r in rows]
