"""dashboard._queries: what the dashboard reads beyond `sqlalchemy_pgtask.status`; never writes.

The last hour's throughput per queue, running tasks and capabilities per worker, and a task's
family tree are the dashboard's own reads; the task list is `dashboard._task_list`.
Everything else (counts by state, one task in detail, workers, schedules, the audit log)
comes from the library's read models, so the dashboard and the ``pgtask`` command cannot
disagree.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Connection, literal, literal_column, select
from sqlalchemy.orm import aliased

from sqlalchemy_pgtask.models import Task, WorkerCapability
from sqlalchemy_pgtask.states import FAILED, RUNNING, SUCCEEDED
from sqlalchemy_pgtask.status import TaskDetail, TaskRef
from sqlalchemy_pgtask.status._overview import finished_by_queue

__all__ = [
    "PAGE_SIZE_MAX",
    "RunningTask",
    "TaskTree",
    "Throughput",
    "capabilities",
    "running_tasks",
    "task_tree",
    "throughput",
]

#: The most rows one page of the task list or the audit log shows.
PAGE_SIZE_MAX: Final = 500
#: The most running tasks the workers page lists.
_RUNNING_MAX: Final = 500


@dataclass(frozen=True)
class Throughput:
    """Tasks of one queue that finished in the last hour."""

    queue: str
    succeeded: int
    failed: int
    cancelled: int

    @property
    def failure_rate(self) -> float | None:
        """Failed among succeeded + failed, 0 to 1; None when none of either finished."""
        done = self.succeeded + self.failed
        return None if done == 0 else self.failed / done


def throughput(connection: Connection, *, window: timedelta = timedelta(hours=1)) -> dict[
    str, Throughput
]:
    """Per queue, the tasks that finished within ``window`` of database now.

    The partial index on finished tasks (``queue, completed_at, state``) leads with the
    queue: a range on ``completed_at`` alone would walk the whole index (every finished task
    of the history). So the queues are found first, one probe each, and each queue's window
    is one range of the index, index only (`status.queue_status` with ``finished_since``).
    """
    counts: dict[str, dict[str, int]] = {}
    for (queue, state), n in finished_by_queue(connection, window).items():
        counts.setdefault(queue, {})[state] = n
    return {
        queue: Throughput(
            queue=queue,
            succeeded=by_state.get(SUCCEEDED, 0),
            failed=by_state.get(FAILED, 0),
            cancelled=by_state.get("cancelled", 0),
        )
        for queue, by_state in counts.items()
    }


@dataclass(frozen=True)
class RunningTask:
    """A task a worker holds the lease of."""

    id: uuid.UUID
    queue: str
    name: str
    attempt: int
    lease_owner: uuid.UUID
    lease_expires_at: datetime


def running_tasks(connection: Connection, workers: Sequence[uuid.UUID]) -> list[RunningTask]:
    """The running tasks leased by ``workers``, oldest lease first, at most 500.

    ``state = 'running'`` is a literal so the partial lease index (running rows only) can
    serve it; terminal history is never read.
    """
    if not workers:
        return []
    rows = connection.execute(
        select(
            Task.id, Task.queue, Task.name, Task.attempt, Task.lease_owner,
            Task.lease_expires_at,
        )
        .where(Task.state == literal_column(f"'{RUNNING}'"), Task.lease_owner.in_(workers))
        .order_by(Task.lease_expires_at, Task.id)
        .limit(_RUNNING_MAX)
    ).all()
    return [
        RunningTask(
            id=r.id, queue=r.queue, name=r.name, attempt=r.attempt, lease_owner=r.lease_owner,
            lease_expires_at=r.lease_expires_at,
        )
        for r in rows
    ]


def capabilities(
    connection: Connection, workers: Sequence[uuid.UUID]
) -> dict[uuid.UUID, list[tuple[str, str, int]]]:
    """Per worker, the ``(queue, name, version)`` identities it registered, sorted."""
    found: dict[uuid.UUID, list[tuple[str, str, int]]] = {}
    if not workers:
        return found
    for row in connection.execute(
        select(
            WorkerCapability.worker_id, WorkerCapability.queue, WorkerCapability.name,
            WorkerCapability.version,
        )
        .where(WorkerCapability.worker_id.in_(workers))
        .order_by(WorkerCapability.queue, WorkerCapability.name, WorkerCapability.version)
    ):
        found.setdefault(row.worker_id, []).append((row.queue, row.name, row.version))
    return found


#: How far the task page's tree reaches: ancestors up, descendants down and in all.
_TREE_DEPTH: Final = 20
_TREE_NODES: Final = 200


@dataclass(frozen=True)
class TaskTree:
    """A task's ancestors (the root first) and descendants (depth first, oldest first)."""

    ancestors: tuple[TaskRef, ...]
    #: ``(depth, task)``: depth 1 are the task's children.
    descendants: tuple[tuple[int, TaskRef], ...]
    #: Whether more descendants exist than the tree shows.
    truncated: bool


def _walk(connection: Connection, start: Any, link: Any, limit: int) -> list[Any]:
    """Rows of a recursive walk from ``start`` along ``link(node, walked)``, with depth."""
    node = aliased(Task)
    first = select(
        Task.id, Task.name, Task.version, Task.state, Task.parent_id, Task.created_at,
        literal(1).label("depth"),
    ).where(start).cte("walk", recursive=True)
    walk = first.union_all(
        select(
            node.id, node.name, node.version, node.state, node.parent_id, node.created_at,
            (first.c.depth + 1).label("depth"),
        ).where(link(node, first), first.c.depth < _TREE_DEPTH)
    )
    # PostgreSQL evaluates a recursive CTE lazily: the LIMIT stops the walk itself.
    return list(connection.execute(select(walk).limit(limit)).all())


def task_tree(connection: Connection, task: TaskDetail) -> TaskTree:
    """The family of ``task``: up through ``parent_id`` (at most 20 levels) and down (at most
    200 tasks, 20 levels), each step served by the primary key or the parent index."""
    ancestors: list[Any] = []
    if task.parent_id is not None:
        ancestors = _walk(
            connection, Task.id == task.parent_id,
            lambda node, walked: node.id == walked.c.parent_id, _TREE_DEPTH,
        )
    rows = _walk(
        connection, Task.parent_id == task.id,
        lambda node, walked: node.parent_id == walked.c.id, _TREE_NODES + 1,
    )
    children: dict[Any, list[Any]] = {}
    for row in sorted(rows[:_TREE_NODES], key=lambda r: (r.created_at, r.id)):
        children.setdefault(row.parent_id, []).append(row)
    ordered: list[tuple[int, TaskRef]] = []
    pending = [(1, row) for row in reversed(children.get(task.id, []))]
    while pending:
        depth, row = pending.pop()
        ordered.append((depth, _ref(row)))
        pending.extend((depth + 1, child) for child in reversed(children.get(row.id, [])))
    return TaskTree(
        ancestors=tuple(_ref(r) for r in sorted(ancestors, key=lambda r: -r.depth)),
        descendants=tuple(ordered),
        truncated=len(rows) > _TREE_NODES,
    )


def _ref(row: Any) -> TaskRef:
    return TaskRef(id=row.id, name=row.name, version=row.version, state=row.state)
