"""status._overview: live workers, queues with their counts by state, and unroutable work."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from sqlalchemy import ColumnElement, Connection, and_, exists, func, literal_column, select, text

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import CapacityRelease, Queue, Task, WorkerCapability, WorkerRecord
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import (
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


def _states_sql(states: tuple[TaskState, ...]) -> str:
    quoted = ", ".join(f"'{state}'" for state in states)
    return f"state IN ({quoted})"


#: The most queues `queue_skip_scan` finds: a history of many thousands of queues costs no
#: more than this many probes.
QUEUES_SCANNED_MAX: Final = 1000


def queue_skip_scan(states: tuple[TaskState, ...]) -> str:
    """The body of a recursive CTE ``queues(queue, found)``: the distinct queues of the tasks
    in ``states`` (the constants of `sqlalchemy_pgtask.states`, never input), one probe each
    of a partial index whose leading column is the queue (PostgreSQL 13 to 17 cannot skip
    through an index on their own), at most `QUEUES_SCANNED_MAX`. The last row's queue is
    NULL: filter it out."""
    where = _states_sql(states)
    return (
        f"(SELECT queue, 1 AS found FROM pgtask.tasks WHERE {where} ORDER BY queue LIMIT 1)"  # noqa: S608
        f" UNION ALL SELECT (SELECT t.queue FROM pgtask.tasks AS t WHERE t.{where}"
        " AND t.queue > q.queue ORDER BY t.queue LIMIT 1), q.found + 1"
        f" FROM queues AS q WHERE q.queue IS NOT NULL AND q.found < {QUEUES_SCANNED_MAX}"
    )


# Per queue, the finished tasks of a recent span by state: one range of the index on
# finished tasks (queue, completed_at, state) per queue, index only.
_FINISHED_SINCE: Final = text(
    f"WITH RECURSIVE queues AS ({queue_skip_scan(TERMINAL_STATES)}) "  # noqa: S608 (constants)
    "SELECT q.queue, f.state, f.n FROM queues AS q CROSS JOIN LATERAL ("
    " SELECT t.state, count(*) AS n FROM pgtask.tasks AS t"
    f" WHERE t.queue = q.queue AND t.{_states_sql(TERMINAL_STATES)}"
    " AND t.completed_at >= pgtask.now() - make_interval(secs => :seconds)"
    " GROUP BY t.state) AS f WHERE q.queue IS NOT NULL"
)


def finished_by_queue(connection: Connection, since: timedelta) -> dict[tuple[str, str], int]:
    """``(queue, state): count`` of the tasks that finished within ``since`` of database now:
    the queues found by `queue_skip_scan`, then one range of the index on finished tasks per
    queue, index only; the cost follows the span's tasks, not the history's."""
    rows = connection.execute(_FINISHED_SINCE, {"seconds": since.total_seconds()})
    return {(r.queue, r.state): r.n for r in rows}


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


def queue_status(
    connection: Connection, *, finished_since: timedelta | None = None
) -> list[QueueStatus]:
    """Every queue with settings or tasks, by name: settings, capacity use and counts by state.

    Four statements, each served by its own index, index only: the settings
    (``pgtask.queues``), the pending tasks with the due part (``ix_tasks_pending_run_at``),
    the running and waiting ones (``ix_tasks_outstanding``) and the finished ones (``state
    IN`` the terminal states, written to match the partial index on terminal tasks). No
    statement reads the table's rows.

    :param finished_since: count only the tasks that finished within this span of database
        now (one range of the index per queue, so the cost follows the span, not the
        history); None (the default) counts every finished task the table holds.
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
    # Pending apart from running and waiting: one statement over all three would read every
    # pending row for its run_at, where (queue, run_at) of the pending tasks is an index.
    pending = {
        r.queue: (r.pending, r.due)
        for r in connection.execute(
            select(
                Task.queue, func.count().label("pending"),
                func.count().filter(Task.run_at <= now).label("due"),
            )
            .where(state_in((PENDING,)))
            .group_by(Task.queue)
        )
    }
    held: dict[tuple[str, str], int] = {
        (r.queue, r.state): r.n
        for r in connection.execute(
            select(Task.queue, Task.state, func.count().label("n"))
            .where(state_in((RUNNING, WAITING)))
            .group_by(Task.queue, Task.state)
        )
    }
    if finished_since is None:
        finished = {
            (r.queue, r.state): r.n for r in connection.execute(
                select(Task.queue, Task.state, func.count().label("n"))
                .where(state_in(TERMINAL_STATES))
                .group_by(Task.queue, Task.state)
            )
        }
    else:
        finished = finished_by_queue(connection, finished_since)
    names = sorted(
        settings.keys() | pending.keys() | {queue for queue, _ in held}
        | {queue for queue, _ in finished}
    )
    queues: list[QueueStatus] = []
    for name in names:
        setting = settings.get(name)
        waiting_now, due = pending.get(name, (0, 0))
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
                pending=waiting_now,
                due=due,
                running=held.get((name, RUNNING), 0),
                waiting=held.get((name, WAITING), 0),
                succeeded=finished.get((name, SUCCEEDED), 0),
                failed=finished.get((name, FAILED), 0),
                cancelled=finished.get((name, CANCELLED), 0),
            )
        )
    return queues


# The next pending tasks of each queue in claim order (``ix_tasks_claim``), at most
# :per_queue each, whose identity no live, non-draining worker registered.
_UNROUTABLE_NEXT: Final = text(
    f"WITH RECURSIVE queues AS ({queue_skip_scan((PENDING,))}) "  # noqa: S608 (constants)
    "SELECT p.queue, p.name, p.version, count(*) AS n"
    " FROM queues AS q CROSS JOIN LATERAL ("
    "  SELECT t.queue, t.name, t.version FROM pgtask.tasks AS t"
    f"  WHERE t.queue = q.queue AND t.{_states_sql((PENDING,))}"
    "  ORDER BY t.priority DESC, t.run_at, t.id LIMIT :per_queue) AS p"
    " WHERE q.queue IS NOT NULL AND NOT EXISTS ("
    "  SELECT 1 FROM pgtask.worker_capabilities AS c"
    "  JOIN pgtask.workers AS w ON w.id = c.worker_id"
    "  WHERE w.expires_at > pgtask.now() AND NOT w.draining"
    "  AND c.queue = p.queue AND c.name = p.name AND c.version = p.version)"
    " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
)


def unroutable(connection: Connection, *, per_queue: int | None = None) -> list[Unroutable]:
    """Pending task identities that no live, non-draining worker can claim.

    :param per_queue: look only at the next this many pending tasks of each queue, in the
        order workers claim them (``ix_tasks_claim``; the counts are then of those), so the
        cost does not follow a large backlog; None (the default) reads every pending task.
    """
    if per_queue is not None:
        if per_queue < 1:
            raise InvalidOptionError("per_queue", f"must be at least 1, got {per_queue}")
        rows = connection.execute(_UNROUTABLE_NEXT, {"per_queue": per_queue}).all()
        return [Unroutable(r.queue, r.name, r.version, r.n) for r in rows]
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
