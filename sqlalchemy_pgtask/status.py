"""status: read models of workers, queues and tasks for operators; never writes.

Every function takes a SQLAlchemy `Connection`, runs only ``SELECT`` statements in the caller's
transaction, and returns frozen dataclasses, so the ``pgtask`` command (and a dashboard of your
own) prints from typed values rather than from rows. Run them in a read-only transaction if you
like: nothing here needs more.

The one question these answer that the tables alone do not: is there pending work that no
live worker can run (an unknown task name or handler version, or no worker on the queue)?
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import ColumnElement, Connection, and_, exists, func, literal_column, select, tuple_

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.errors import InvalidOptionError, TaskNotFound
from sqlalchemy_pgtask.models import Attempt, Queue, Task, WorkerCapability, WorkerRecord
from sqlalchemy_pgtask.states import (
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    SUCCEEDED,
    TASK_STATES,
    TERMINAL_STATES,
    WAITING,
    AttemptState,
    TaskState,
)
from sqlalchemy_pgtask.validation import check_int_range, check_queue_name, check_task_name

__all__ = [
    "LIST_LIMIT_MAX",
    "AttemptInfo",
    "QueueSettings",
    "QueueStatus",
    "TaskDetail",
    "TaskSummary",
    "Unroutable",
    "WorkerInfo",
    "check_list_filters",
    "list_tasks",
    "live_workers",
    "parse_task_id",
    "queue_settings",
    "queue_status",
    "schema_installed",
    "task_detail",
    "task_summary",
    "unroutable",
]

#: The most tasks `list_tasks` returns at once; page further with ``before``.
LIST_LIMIT_MAX: Final = 10_000


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
class QueueSettings:
    """A ``pgtask.queues`` row: the settings of one queue."""

    name: str
    paused_at: datetime | None
    max_outstanding_tasks: int | None
    #: The admission counter, maintained only while ``max_outstanding_tasks`` is set.
    outstanding_tasks: int
    terminal_retention_seconds: int
    idempotency_retention_seconds: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Unroutable:
    """Pending tasks of one identity that no live, non-draining worker has registered."""

    queue: str
    name: str
    version: int
    count: int


@dataclass(frozen=True)
class TaskSummary:
    """One task, without its payload, result, headers and error: a line of a listing."""

    id: uuid.UUID
    queue: str
    name: str
    version: int
    state: TaskState
    priority: int
    attempt: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None


@dataclass(frozen=True)
class AttemptInfo:
    """One claim of a task: who ran it, when, and how it ended."""

    attempt: int
    state: AttemptState
    worker_id: uuid.UUID | None
    started_at: datetime
    finished_at: datetime | None
    #: The stored error document (``type``, ``exception``, ``message``, ``traceback`` ...).
    error: dict[str, Any] | None


@dataclass(frozen=True)
class TaskDetail(TaskSummary):
    """Everything stored about one task, and its attempts in order."""

    failed_attempts: int
    payload: Any
    headers: dict[str, Any]
    result: Any
    #: The error of the latest failure (``type``, ``exception``, ``message``, ``traceback``).
    error: dict[str, Any] | None
    idempotency_key: str | None
    parent_id: uuid.UUID | None
    lease_owner: uuid.UUID | None
    lease_expires_at: datetime | None
    cancel_requested_at: datetime | None
    retry_kind: str | None
    retry_base_seconds: float | None
    retry_factor: float | None
    retry_max_seconds: float | None
    retry_jitter: bool | None
    attempts: tuple[AttemptInfo, ...]


def parse_task_id(value: uuid.UUID | str) -> uuid.UUID:
    """``value`` as a task id; raises `InvalidOptionError` when it is not a UUID."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError as exc:
        raise InvalidOptionError("task_id", f"{value!r} is not a UUID") from exc


def schema_installed(connection: Connection) -> bool:
    """Whether the pgtask schema is installed in the connected database."""
    return bool(connection.execute(statements.SCHEMA_INSTALLED).scalar_one())


def _state_in(states: tuple[TaskState, ...]) -> ColumnElement[bool]:
    """``state IN ('a', 'b')`` with literal states, so it matches a partial index's predicate
    in any plan; bound parameters would match only in a custom plan. The states are the
    constants of `sqlalchemy_pgtask.states`, never input."""
    return Task.state.in_([literal_column(f"'{state}'") for state in states])


def live_workers(connection: Connection) -> list[WorkerInfo]:
    """Workers whose heartbeat has not expired, newest first (``ix_workers_expires_at``)."""
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
            id=r.id, hostname=r.hostname, pid=r.pid, queues=tuple(r.queues), version=r.version,
            concurrency=r.concurrency, draining=r.draining, started_at=r.started_at,
            heartbeat_age_seconds=float(r.age),
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
    now = func.statement_timestamp()
    queues_table = select(
        Queue.name, Queue.paused_at, Queue.max_outstanding_tasks, Queue.outstanding_tasks
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
            .where(_state_in(ACTIVE_STATES))
            .group_by(Task.queue)
        )
    }
    finished: dict[tuple[str, str], int] = {
        (r.queue, r.state): r.n
        for r in connection.execute(
            select(Task.queue, Task.state, func.count().label("n"))
            .where(_state_in(TERMINAL_STATES))
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
        select(Task.queue, Task.name, Task.version, func.count().label("n"))
        .where(_state_in((PENDING,)), ~capable)
        .group_by(Task.queue, Task.name, Task.version)
        .order_by(Task.queue, Task.name, Task.version)
    ).all()
    return [Unroutable(r.queue, r.name, r.version, r.n) for r in rows]


_SUMMARY_COLUMNS: Final = (
    Task.id, Task.queue, Task.name, Task.version, Task.state, Task.priority, Task.attempt,
    Task.max_attempts, Task.run_at, Task.created_at, Task.updated_at, Task.completed_at,
)


def _summary(row: Any) -> TaskSummary:
    return TaskSummary(**{column.key: getattr(row, column.key) for column in _SUMMARY_COLUMNS})


def task_summary(connection: Connection, task_id: uuid.UUID | str) -> TaskSummary | None:
    """The task with that id, without its documents; None if there is none."""
    row = connection.execute(
        select(*_SUMMARY_COLUMNS).where(Task.id == parse_task_id(task_id))
    ).first()
    return None if row is None else _summary(row)


def check_list_filters(
    *,
    state: str | None = None,
    queue: str | None = None,
    name: str | None = None,
    limit: int = 50,
) -> None:
    """Raise a `ValidationError` if `list_tasks` would refuse these filters (no I/O)."""
    if state is not None and state not in TASK_STATES:
        raise InvalidOptionError(
            "state", f"{state!r} is not a task state ({', '.join(TASK_STATES)})"
        )
    if queue is not None:
        check_queue_name(queue)
    if name is not None:
        check_task_name(name)
    check_int_range("limit", limit, 1, LIST_LIMIT_MAX)


def list_tasks(
    connection: Connection,
    *,
    state: TaskState | None = None,
    queue: str | None = None,
    name: str | None = None,
    limit: int = 50,
    before: uuid.UUID | str | None = None,
) -> list[TaskSummary]:
    """The newest tasks first (by ``created_at``, then ``id``), at most ``limit``.

    The filters combine with AND. ``before`` is a keyset cursor: pass the last id of a page
    to get the next (older) one; it raises `TaskNotFound` if that task no longer exists. The
    order is a plain ``ORDER BY created_at DESC, id DESC LIMIT n``, which an index on
    ``(created_at, id)`` would serve without sorting; today the tasks matching the filters
    are sorted (a top-n sort, memory bounded by ``limit``). Invalid filters raise a
    `ValidationError` before any SQL runs.
    """
    check_list_filters(state=state, queue=queue, name=name, limit=limit)
    cursor = None if before is None else parse_task_id(before)
    statement = select(*_SUMMARY_COLUMNS)
    if state is not None:
        statement = statement.where(Task.state == state)
    if queue is not None:
        statement = statement.where(Task.queue == queue)
    if name is not None:
        statement = statement.where(Task.name == name)
    if cursor is not None:
        last = connection.execute(
            select(Task.created_at, Task.id).where(Task.id == cursor)
        ).first()
        if last is None:
            raise TaskNotFound(f"no task with id {cursor}")
        statement = statement.where(
            tuple_(Task.created_at, Task.id) < tuple_(last.created_at, last.id)
        )
    rows = connection.execute(
        statement.order_by(Task.created_at.desc(), Task.id.desc()).limit(limit)
    )
    return [_summary(row) for row in rows]


def task_detail(connection: Connection, task_id: uuid.UUID | str) -> TaskDetail | None:
    """Everything about one task and its attempts (oldest first); None if there is none."""
    wanted = parse_task_id(task_id)
    tasks = Task.__table__
    row = connection.execute(select(tasks).where(tasks.c.id == wanted)).mappings().first()
    if row is None:
        return None
    attempts = connection.execute(
        select(
            Attempt.attempt, Attempt.state, Attempt.worker_id, Attempt.started_at,
            Attempt.finished_at, Attempt.error,
        )
        .where(Attempt.task_id == wanted)
        .order_by(Attempt.attempt)
    )
    fields = {f.name: row[f.name] for f in dataclasses.fields(TaskDetail) if f.name != "attempts"}
    return TaskDetail(
        **fields,
        attempts=tuple(
            AttemptInfo(
                attempt=a.attempt, state=a.state, worker_id=a.worker_id,
                started_at=a.started_at, finished_at=a.finished_at, error=a.error,
            )
            for a in attempts
        ),
    )


def queue_settings(connection: Connection, name: str | None = None) -> list[QueueSettings]:
    """The ``pgtask.queues`` rows (or the one for ``name``), by name."""
    statement = select(
        Queue.name, Queue.paused_at, Queue.max_outstanding_tasks, Queue.outstanding_tasks,
        Queue.terminal_retention_seconds, Queue.idempotency_retention_seconds,
        Queue.created_at, Queue.updated_at,
    ).order_by(Queue.name)
    if name is not None:
        statement = statement.where(Queue.name == check_queue_name(name))
    return [QueueSettings(**row._mapping) for row in connection.execute(statement)]
