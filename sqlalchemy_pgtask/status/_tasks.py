"""status._tasks: one task in detail, and listings of tasks for operators."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, literal_column, select, tuple_

from sqlalchemy_pgtask._connection import parse_task_id
from sqlalchemy_pgtask.errors import InvalidOptionError, TaskNotFound
from sqlalchemy_pgtask.models import Attempt, Task
from sqlalchemy_pgtask.states import TASK_STATES, AttemptState, TaskState
from sqlalchemy_pgtask.status._durable import (
    StepInfo,
    TaskRef,
    WaitInfo,
    durable_view,
    newest,
)
from sqlalchemy_pgtask.validation import (
    check_concurrency_key,
    check_int_range,
    check_queue_name,
    check_task_name,
)

__all__ = [
    "LIST_LIMIT_MAX",
    "AttemptInfo",
    "TaskDetail",
    "TaskSummary",
    "check_list_filters",
    "list_tasks",
    "task_detail",
    "task_summary",
]

#: The most tasks `list_tasks` returns at once; page further with ``before``.
LIST_LIMIT_MAX: Final = 10_000


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
    #: None until the first claim fills in the handler's.
    max_attempts: int | None
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
    """Everything stored about one task: its attempts, and its durable steps, wait, children
    and parent (empty for a task whose handler made no durable call)."""

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
    #: Its checkpoints, oldest first.
    steps: tuple[StepInfo, ...] = ()
    #: What it waits for now: a signal or a child (``waiting``), or a sleep's end (``pending``).
    wait: WaitInfo | None = None
    #: The tasks it spawned, oldest first.
    children: tuple[TaskRef, ...] = ()
    #: The task that spawned it (``parent_id``), if that task still exists.
    parent: TaskRef | None = None
    #: How many older attempts, steps and children `task_detail`'s limits left out.
    attempts_omitted: int = 0
    steps_omitted: int = 0
    children_omitted: int = 0
    #: Its concurrency key and own limit (None: its handler's, or 1), docs/concurrency.md.
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    #: The tasks holding its key now (running, or suspended with it held), at most 20.
    concurrency_holders: tuple[uuid.UUID, ...] = ()


#: `TaskDetail` fields that are not columns of the task's row.
_RELATED: Final = frozenset({
    "attempts", "steps", "wait", "children", "parent", "attempts_omitted", "steps_omitted",
    "children_omitted", "concurrency_holders",
})
#: Holders `task_detail` lists at most.
_HOLDERS_SHOWN: Final = 20

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
    key: str | None = None,
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
    if key is not None:
        check_concurrency_key(key, "key")
    check_int_range("limit", limit, 1, LIST_LIMIT_MAX)


def list_tasks(
    connection: Connection,
    *,
    state: TaskState | None = None,
    queue: str | None = None,
    name: str | None = None,
    limit: int = 50,
    before: uuid.UUID | str | None = None,
    key: str | None = None,
) -> list[TaskSummary]:
    """The newest tasks first (by ``created_at``, then ``id``), at most ``limit``.

    The filters combine with AND (``key``: a concurrency key). ``before`` is a keyset cursor:
    pass the last id of a page to get the next (older) one; it raises `TaskNotFound` if that
    task no longer exists. The order is a plain ``ORDER BY created_at DESC, id DESC LIMIT
    n``, which an index on ``(created_at, id)`` would serve without sorting; today the tasks
    matching the filters are sorted (a top-n sort, memory bounded by ``limit``). Invalid
    filters raise a `ValidationError` before any SQL runs.
    """
    check_list_filters(state=state, queue=queue, name=name, limit=limit, key=key)
    cursor = None if before is None else parse_task_id(before)
    statement = select(*_SUMMARY_COLUMNS)
    if state is not None:
        statement = statement.where(Task.state == state)
    if queue is not None:
        statement = statement.where(Task.queue == queue)
    if name is not None:
        statement = statement.where(Task.name == name)
    if key is not None:
        statement = statement.where(Task.concurrency_key == key)
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


def task_detail(
    connection: Connection,
    task_id: uuid.UUID | str,
    *,
    attempts_limit: int | None = None,
    steps_limit: int | None = None,
    children_limit: int | None = None,
) -> TaskDetail | None:
    """Everything about one task, its attempts, steps and children (each oldest first), its
    wait and its parent; None if there is none. Run it in a ``REPEATABLE READ`` transaction
    for one consistent snapshot: it reads with up to nine statements.

    Each limit keeps only the newest attempts, steps or children (None: all of them), and the
    ``*_omitted`` fields say how many older ones it left out: a long workflow (100,000 steps)
    then costs a bounded read. A limit must be 1 to `LIST_LIMIT_MAX`: `ValidationError`
    before any SQL otherwise.
    """
    wanted = parse_task_id(task_id)
    for field, limit in (
        ("attempts_limit", attempts_limit), ("steps_limit", steps_limit),
        ("children_limit", children_limit),
    ):
        if limit is not None:
            check_int_range(field, limit, 1, LIST_LIMIT_MAX)
    tasks = Task.__table__
    row = connection.execute(select(tasks).where(tasks.c.id == wanted)).mappings().first()
    if row is None:
        return None
    attempt_rows, attempts_omitted = newest(
        connection,
        select(
            Attempt.attempt, Attempt.state, Attempt.worker_id, Attempt.started_at,
            Attempt.finished_at, Attempt.error,
        ).where(Attempt.task_id == wanted),
        (Attempt.attempt,),
        attempts_limit,
    )
    attempts = tuple(
        AttemptInfo(
            attempt=a.attempt, state=a.state, worker_id=a.worker_id,
            started_at=a.started_at, finished_at=a.finished_at, error=a.error,
        )
        for a in attempt_rows
    )
    durable = durable_view(
        connection, wanted, state=row["state"], run_at=row["run_at"], parent_id=row["parent_id"],
        steps_limit=steps_limit, children_limit=children_limit,
    )
    fields = {
        f.name: row[f.name] for f in dataclasses.fields(TaskDetail) if f.name not in _RELATED
    }
    return TaskDetail(
        **fields,
        attempts=attempts,
        steps=durable.steps,
        wait=durable.wait,
        children=durable.children,
        parent=durable.parent,
        attempts_omitted=attempts_omitted,
        steps_omitted=durable.steps_omitted,
        children_omitted=durable.children_omitted,
        concurrency_holders=_holders(connection, row),
    )


def _holders(connection: Connection, row: Any) -> tuple[uuid.UUID, ...]:
    if row["concurrency_key"] is None:
        return ()
    holding = (Task.state == literal_column("'running'")) | Task.concurrency_held
    return tuple(connection.execute(
        select(Task.id)
        .where(
            Task.queue == row["queue"], Task.name == row["name"],
            Task.concurrency_key == row["concurrency_key"], holding,
        )
        .order_by(Task.id)
        .limit(_HOLDERS_SHOWN)
    ).scalars())


