"""explain.facts: what `explain` reads about one task and what it depends on; only ``SELECT``
statements, never a lock.

Each read is asked only when the task's state makes it matter (a running task's worker, a
waiting task's wait, a pending task's queue, rate bucket and live workers), so a plain task
costs a handful of primary-key and index probes. Every time is database time: the task row is
read together with ``pgtask.now()``, and a rate bucket's refill is computed by the server.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import (
    Connection,
    Double,
    any_,
    bindparam,
    cast,
    func,
    literal,
    literal_column,
    select,
)

from sqlalchemy_pgtask.models import (
    Attempt,
    AuditEntry,
    Checkpoint,
    Queue,
    RateBucket,
    Task,
    Wait,
    WorkerCapability,
    WorkerRecord,
)
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import (
    ACTIVE_STATES,
    CANCELLED,
    PENDING,
    RUNNING,
    WAITING,
    TaskState,
)

__all__ = [
    "Facts",
    "HandlerWorker",
    "PauseFacts",
    "RateFacts",
    "RunningFacts",
    "WaitFacts",
    "read_facts",
    "refill_time",
]

#: Tables an observer may be unable to read (see docs/roles.md): asked about first, so a
#: missing privilege leaves a detail out instead of aborting the caller's transaction.
_GUARDED: Final = ("pgtask.rate_buckets", "pgtask.audit_log")
#: The audit actions that start and end a task's cancellation story.
_CANCEL_OR_RETRY: Final = ("task.cancel", "task.retry")


@dataclass(frozen=True)
class HandlerWorker:
    """A live worker that registered the task's name on its queue, in one version."""

    id: uuid.UUID
    version: int
    draining: bool
    concurrency: int
    #: Tasks it runs now (of any queue): its slots are shared by all its queues.
    running: int


@dataclass(frozen=True)
class PauseFacts:
    paused_at: datetime
    actor: str | None
    reason: str | None


@dataclass(frozen=True)
class RateFacts:
    limit: int
    period_seconds: float
    #: Whole tokens cannot be told when the role may not read ``pgtask.rate_buckets``.
    readable: bool
    #: Tokens in the bucket now; None when there is no bucket yet (it starts full).
    available: float | None


@dataclass(frozen=True)
class WaitFacts:
    kind: str
    step: str
    since: datetime
    timeout_at: datetime | None
    signal_name: str | None
    signal_occurrence: int | None
    child_id: uuid.UUID | None
    #: The child's state and identity, if it still exists.
    child_state: TaskState | None
    child_name: str | None


@dataclass(frozen=True)
class RunningFacts:
    started_at: datetime | None
    deadline_at: datetime | None
    worker_alive: bool
    hostname: str | None
    pid: int | None


@dataclass(frozen=True)
class Facts:
    """One task's row and, depending on its state, what holds it where it is."""

    task: Any
    now: datetime
    #: Pending: the latest checkpoint's (step, kind, value), to tell a durable sleep.
    latest_step: tuple[str, str, Any] | None = None
    pause: PauseFacts | None = None
    rate: RateFacts | None = None
    handlers: tuple[HandlerWorker, ...] = ()
    #: Pending: live workers, and those of them not draining that serve the task's queue.
    live_workers: int = 0
    serving_workers: int = 0
    #: Pending, in a queue with a capacity: (outstanding tasks, the capacity).
    capacity: tuple[int, int] | None = None
    wait: WaitFacts | None = None
    running: RunningFacts | None = None
    #: Cancelled: the latest ``task.cancel`` audit entry's actor and reason.
    cancel_actor: str | None = None
    cancel_reason: str | None = None

    @property
    def due(self) -> bool:
        return bool(self.task.run_at <= self.now)


def _readable(connection: Connection) -> dict[str, bool]:
    columns = [
        func.has_table_privilege(bindparam(f"t{i}", table), "SELECT").label(f"t{i}")
        for i, table in enumerate(_GUARDED)
    ]
    row = connection.execute(select(*columns)).one()
    return {table: bool(row[i]) for i, table in enumerate(_GUARDED)}


#: The newest checkpoint's (step, kind, value), or None: a task without one.
LatestStep = tuple[str, str, Any] | None
#: How `read_facts` finds a task's newest checkpoint (a caller that read it already in the same
#: snapshot, the dashboard's task page, hands it over instead of a second full read).
StepReader = Callable[[Connection, uuid.UUID], LatestStep]


def _latest_step(connection: Connection, task_id: uuid.UUID) -> LatestStep:
    # The reverse of the order status shows steps in: the last of them is the latest.
    row = connection.execute(
        select(Checkpoint.step, Checkpoint.kind, Checkpoint.value)
        .where(Checkpoint.task_id == task_id)
        .order_by(
            Checkpoint.created_at.desc(), Checkpoint.step.desc(), Checkpoint.occurrence.desc()
        )
        .limit(1)
    ).first()
    return None if row is None else (row.step, row.kind, row.value)


def _pause(
    connection: Connection, queue: str, paused_at: datetime, audit: bool
) -> PauseFacts:
    if not audit:
        return PauseFacts(paused_at, None, None)
    entry = connection.execute(
        select(AuditEntry.actor, AuditEntry.reason)
        .where(AuditEntry.action == "queue.pause", AuditEntry.queue == queue)
        .order_by(AuditEntry.id.desc())
        .limit(1)
    ).first()
    return PauseFacts(paused_at, *(entry or (None, None)))


def _handlers(connection: Connection, queue: str, name: str) -> tuple[HandlerWorker, ...]:
    running = (
        select(func.count())
        .where(
            Task.state == literal_column(f"'{RUNNING}'"),  # matches the partial lease index
            Task.lease_owner == WorkerRecord.id,
        )
        .scalar_subquery()
    )
    rows = connection.execute(
        select(
            WorkerRecord.id, WorkerCapability.version, WorkerRecord.draining,
            WorkerRecord.concurrency, running.label("running"),
        )
        .join(WorkerCapability, WorkerCapability.worker_id == WorkerRecord.id)
        .where(
            WorkerRecord.expires_at > NOW,
            WorkerCapability.queue == queue,
            WorkerCapability.name == name,
        )
        .order_by(WorkerRecord.started_at, WorkerRecord.id, WorkerCapability.version)
    )
    return tuple(
        HandlerWorker(r.id, r.version, r.draining, r.concurrency, r.running) for r in rows
    )


def _workers(connection: Connection, queue: str) -> tuple[int, int]:
    """Live workers, and those of them not draining that serve ``queue`` (through
    ``ix_workers_expires_at``)."""
    serving = WorkerRecord.draining.is_(False) & (literal(queue) == any_(WorkerRecord.queues))
    row = connection.execute(
        select(func.count().label("live"), func.count().filter(serving).label("serving"))
        .select_from(WorkerRecord)
        .where(WorkerRecord.expires_at > NOW)
    ).one()
    return int(row.live), int(row.serving)


def _wait(connection: Connection, task_id: uuid.UUID) -> WaitFacts | None:
    row = connection.execute(
        select(
            Wait.kind, Wait.step, Wait.created_at, Wait.timeout_at, Wait.signal_name,
            Wait.signal_occurrence, Wait.child_id,
        ).where(Wait.task_id == task_id)
    ).first()
    if row is None:
        return None
    child = None
    if row.child_id is not None:
        child = connection.execute(
            select(Task.state, Task.name).where(Task.id == row.child_id)
        ).first()
    return WaitFacts(
        kind=row.kind, step=row.step, since=row.created_at, timeout_at=row.timeout_at,
        signal_name=row.signal_name, signal_occurrence=row.signal_occurrence,
        child_id=row.child_id, child_state=None if child is None else child.state,
        child_name=None if child is None else child.name,
    )


def _running(connection: Connection, task: Any) -> RunningFacts:
    attempt = connection.execute(
        select(Attempt.started_at, Attempt.deadline_at).where(
            Attempt.task_id == task.id, Attempt.attempt == task.attempt
        )
    ).first()
    worker = connection.execute(
        select(
            WorkerRecord.hostname, WorkerRecord.pid,
            (WorkerRecord.expires_at > NOW).label("alive"),
        ).where(WorkerRecord.id == task.lease_owner)
    ).first()
    return RunningFacts(
        started_at=None if attempt is None else attempt.started_at,
        deadline_at=None if attempt is None else attempt.deadline_at,
        worker_alive=worker is not None and bool(worker.alive),
        hostname=None if worker is None else worker.hostname,
        pid=None if worker is None else worker.pid,
    )


def _cancel_entry(connection: Connection, task_id: uuid.UUID) -> tuple[str | None, str | None]:
    # A ``task.retry`` after the latest ``task.cancel`` began a new life of the task: that
    # cancel entry is about an earlier one, and this cancellation was nobody's call by hand
    # (an ancestor's end, a parent's wait timeout, lease recovery).
    entry = connection.execute(
        select(AuditEntry.action, AuditEntry.actor, AuditEntry.reason)
        .where(AuditEntry.task_id == task_id, AuditEntry.action.in_(_CANCEL_OR_RETRY))
        .order_by(AuditEntry.id.desc())
        .limit(1)
    ).first()
    if entry is None or entry.action != "task.cancel":
        return None, None
    return entry.actor, entry.reason


def _pending(connection: Connection, task: Any, latest_step: StepReader) -> dict[str, Any]:
    readable = _readable(connection)
    settings = connection.execute(
        select(
            Queue.paused_at, Queue.rate_limit, Queue.rate_period_seconds,
            Queue.max_outstanding_tasks,
        ).where(Queue.name == task.queue)
    ).first()
    pause = rate = capacity = None
    if settings is not None and settings.paused_at is not None:
        pause = _pause(connection, task.queue, settings.paused_at, readable["pgtask.audit_log"])
    if settings is not None and settings.rate_limit is not None:
        rate = RateFacts(
            settings.rate_limit, settings.rate_period_seconds,
            readable["pgtask.rate_buckets"], None,
        )
        if rate.readable:
            rate = _bucket(connection, task.queue, rate)
    if settings is not None and settings.max_outstanding_tasks is not None:
        capacity = (_outstanding(connection, task.queue), settings.max_outstanding_tasks)
    live, serving = _workers(connection, task.queue)
    return {
        "capacity": capacity,
        "latest_step": latest_step(connection, task.id),
        "pause": pause,
        "rate": rate,
        "handlers": _handlers(connection, task.queue, task.name),
        "live_workers": live,
        "serving_workers": serving,
    }


def _outstanding(connection: Connection, queue: str) -> int:
    # Counted, not the admission counter: its releases are folded in lazily.
    return int(connection.execute(
        select(func.count()).select_from(Task)
        .where(Task.queue == queue, Task.state.in_(ACTIVE_STATES))
    ).scalar_one())


def _bucket(connection: Connection, queue: str, rate: RateFacts) -> RateFacts:
    # The claim's own refill (statements._governed.buckets), read without its lock. No
    # bucket yet: the next governed claim creates it full.
    elapsed = func.greatest(0.0, func.extract("epoch", NOW - RateBucket.refilled_at))
    refilled = RateBucket.tokens + elapsed * rate.limit / rate.period_seconds
    available = connection.execute(
        select(func.least(cast(rate.limit, Double), refilled)).where(RateBucket.queue == queue)
    ).scalar_one_or_none()
    return RateFacts(
        rate.limit, rate.period_seconds, True, None if available is None else float(available)
    )


def refill_time(rate: RateFacts, now: datetime) -> datetime | None:
    """When the bucket holds a whole token again; None if it holds one now (or is unknown)."""
    if rate.available is None or rate.available >= 1.0:
        return None
    return now + timedelta(seconds=(1.0 - rate.available) * rate.period_seconds / rate.limit)


def read_facts(
    connection: Connection, task_id: uuid.UUID, latest_step: StepReader | None = None
) -> Facts | None:
    """The facts about ``task_id``, or None if there is no such task. Locks nothing.

    ``latest_step`` reads the newest checkpoint (by default, a top-1 read of the task's)."""
    task = connection.execute(
        select(
            Task.id, Task.queue, Task.name, Task.version, Task.state, Task.run_at,
            Task.attempt, Task.failed_attempts, Task.max_attempts, Task.lease_owner,
            Task.lease_expires_at, Task.cancel_requested_at, Task.error, Task.completed_at,
            Task.priority, Task.concurrency_key, Task.concurrency_limit, Task.concurrency_held,
            NOW.label("now"),
        ).where(Task.id == task_id)
    ).first()
    if task is None:
        return None
    now: datetime = task.now
    if task.state == PENDING:
        return Facts(task, now, **_pending(connection, task, latest_step or _latest_step))
    if task.state == WAITING:
        return Facts(task, now, wait=_wait(connection, task.id))
    if task.state == RUNNING:
        return Facts(task, now, running=_running(connection, task))
    if task.state == CANCELLED and _readable(connection)["pgtask.audit_log"]:
        actor, reason = _cancel_entry(connection, task.id)
        return Facts(task, now, cancel_actor=actor, cancel_reason=reason)
    return Facts(task, now)
