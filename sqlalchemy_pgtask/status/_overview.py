"""status._overview: live workers, queues with their counts by state, and unroutable work."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, Connection, and_, exists, func, literal_column, select

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.models import CapacityRelease, Queue, Task, WorkerCapability, WorkerRecord
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import (
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATES,
    WAITING,
    TaskState,
)

__all__ = [
    "QueueStatus",
    "Unroutable",
    "WorkerInfo",
    "live_workers",
    "queue_status",
    "schema_installed",
    "state_in",
    "unroutable",
]


@dataclass(frozen=True)
class WorkerInfo:
    """A worker whose heartbeat has not expired."""

    id: uuid.UUID
    hostname: str
    pid: int
    queues: tuple[str, ...]
    version: str
    concurrency: int
    draining: bool
    started_at: datetime
    heartbeat_age_seconds: float
    #: How long a heartbeat keeps the worker live (``expires_at - heartbeat_at``).
    ttl_seconds: float = 0.0

    @property
    def heartbeat_stopped(self) -> bool:
        """Its last heartbeat is older than half its TTL: a live worker beats at least
        twice as often (``heartbeat_interval`` < ``worker_ttl``, by default a third), so it
        cannot reach the database (or its process is frozen). It expires at the TTL."""
        return self.ttl_seconds > 0 and self.heartbeat_age_seconds > self.ttl_seconds / 2


@dataclass(frozen=True)
class QueueStatus:
    """A queue that has settings or tasks: its settings, and its tasks counted by state.

    ``due`` is the part of ``pending`` whose ``run_at`` has come. Terminal counts cover the
    finished tasks retention has not deleted yet.
    """

    name: str
    #: Whether a ``pgtask.queues`` row exists; without one the queue uses the defaults.
    configured: bool
    paused_at: datetime | None
    #: Capacity (most outstanding tasks); None means unlimited.
    max_outstanding_tasks: int | None
    #: The admission counter enqueue checks against the capacity (None when unlimited).
    outstanding_tasks: int | None
    pending: int
    due: int
    running: int
    waiting: int
    succeeded: int
    failed: int
    cancelled: int

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def count(self, state: TaskState) -> int:
        """Tasks of this queue in ``state`` (each state has a field of its name)."""
        return int(getattr(self, state))


@dataclass(frozen=True)
class Unroutable:
    """Pending tasks of one identity that no live, non-draining worker has registered."""

    queue: str
    name: str
    version: int
    count: int


def schema_installed(connection: Connection) -> bool:
    """Whether the pgtask schema is installed in the connected database."""
    return bool(connection.execute(statements.SCHEMA_INSTALLED).scalar_one())


def state_in(states: tuple[TaskState, ...]) -> ColumnElement[bool]:
    """``state IN ('a', 'b')`` with literal states, so it matches a partial index's predicate
    in any plan; bound parameters would match only in a custom plan. The states are the
    constants of `sqlalchemy_pgtask.states`, never input."""
    return Task.state.in_([literal_column(f"'{state}'") for state in states])


def live_workers(connection: Connection) -> list[WorkerInfo]:
    """Workers whose heartbeat has not expired, newest first (``ix_workers_expires_at``)."""
    now = NOW
    rows = connection.execute(
        select(
            WorkerRecord.id, WorkerRecord.hostname, WorkerRecord.pid, WorkerRecord.queues,
            WorkerRecord.version, WorkerRecord.concurrency, WorkerRecord.draining,
            WorkerRecord.started_at,
            func.extract("epoch", now - WorkerRecord.heartbeat_at).label("age"),
            func.extract("epoch", WorkerRecord.expires_at - WorkerRecord.heartbeat_at).label("ttl"),
        )
        .where(WorkerRecord.expires_at > now)
        .order_by(WorkerRecord.started_at.desc())
    ).all()
    return [
        WorkerInfo(
            id=r.id, hostname=r.hostname, pid=r.pid, queues=tuple(r.queues), version=r.version,
            concurrency=r.concurrency, draining=r.draining, started_at=r.started_at,
            heartbeat_age_seconds=float(r.age), ttl_seconds=float(r.ttl),
        )
        for r in rows
    ]


def queue_status(connection: Connection) -> list[QueueStatus]:
    """Every queue with settings or tasks, by name: settings, capacity use and counts by state.

    Three statements, each served by its own index: the settings (``pgtask.queues``), the
    outstanding tasks (the partial index on pending, running and waiting tasks) and the
    finished ones (``state IN`` the terminal states, written to match a partial index on
    terminal tasks). No statement reads every task.
    """
    now = NOW
    released = (
        select(func.coalesce(func.sum(CapacityRelease.released), 0))
        .where(CapacityRelease.queue == Queue.name)
        .scalar_subquery()
    )
    queues_table = select(
        Queue.name, Queue.paused_at, Queue.max_outstanding_tasks,
        (Queue.outstanding_tasks - released).label("outstanding_tasks"),
    )
    settings = {r.name: r for r in connection.execute(queues_table)}
    active = {
        r.queue: r
        for r in connection.execute(
            select(
                Task.queue,
                func.count().filter(Task.state == PENDING).label("pending"),
                func.count().filter(Task.state == PENDING, Task.run_at <= now).label("due"),
                func.count().filter(Task.state == RUNNING).label("running"),
                func.count().filter(Task.state == WAITING).label("waiting"),
            )
            .where(state_in(ACTIVE_STATES))
            .group_by(Task.queue)
        )
    }
    finished: dict[tuple[str, str], int] = {
        (r.queue, r.state): r.n
        for r in connection.execute(
            select(Task.queue, Task.state, func.count().label("n"))
            .where(state_in(TERMINAL_STATES))
            .group_by(Task.queue, Task.state)
        )
    }
    names = sorted(settings.keys() | active.keys() | {queue for queue, _ in finished})
    queues: list[QueueStatus] = []
    for name in names:
        setting, counts = settings.get(name), active.get(name)
        capacity = counter = None
        if setting is not None and setting.max_outstanding_tasks is not None:
            # The counter is maintained only while a capacity is set.
            capacity, counter = setting.max_outstanding_tasks, setting.outstanding_tasks
        queues.append(
            QueueStatus(
                name=name,
                configured=setting is not None,
                paused_at=None if setting is None else setting.paused_at,
                max_outstanding_tasks=capacity,
                outstanding_tasks=counter,
                pending=counts.pending if counts else 0,
                due=counts.due if counts else 0,
                running=counts.running if counts else 0,
                waiting=counts.waiting if counts else 0,
                succeeded=finished.get((name, SUCCEEDED), 0),
                failed=finished.get((name, FAILED), 0),
                cancelled=finished.get((name, CANCELLED), 0),
            )
        )
    return queues


def unroutable(connection: Connection) -> list[Unroutable]:
    """Pending task identities that no live, non-draining worker can claim."""
    now = NOW
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
        select(Task.queue, Task.name, Task.version, func.count().label("n"))
        .where(state_in((PENDING,)), ~capable)
        .group_by(Task.queue, Task.name, Task.version)
        .order_by(Task.queue, Task.name, Task.version)
    ).all()
    return [Unroutable(r.queue, r.name, r.version, r.n) for r in rows]
