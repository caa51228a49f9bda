"""status._durable: a task's durable side for operators: its steps, what it waits for (a signal,
a child or the end of a sleep), its parent and its children; never writes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Literal

from sqlalchemy import Connection, Select, func, select

from sqlalchemy_pgtask.models import Checkpoint, Task, Wait
from sqlalchemy_pgtask.models._durable import sleep_deadline
from sqlalchemy_pgtask.states import TaskState

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "DurableView",
    "StepInfo",
    "TaskRef",
    "WaitInfo",
    "WaitKind",
    "durable_view",
]

#: What a task waits for: a signal or a child's end (it is ``waiting``), or the end of a
#: durable sleep (it is ``pending`` until its wake time).
WaitKind = Literal["signal", "child", "sleep"]


@dataclass(frozen=True)
class StepInfo:
    """One checkpoint: the stored outcome of one durable call of the task's handler."""

    step: str
    occurrence: int
    #: The handler version it belongs to (a new version replays none of an older one's).
    version: int
    #: ``step``, ``sleep``, ``signal``, ``spawn``, ``result`` or ``transaction``.
    kind: str
    created_at: datetime
    #: The stored JSON value: a step's result, ``{"wake_at": ...}`` for a sleep,
    #: ``{"signal": ...}`` or ``{"timeout": true}`` for a signal, ``{"task_id": ...}`` for a
    #: spawn, ``{"state", "result", "error"}`` for a child's result.
    value: Any


@dataclass(frozen=True)
class WaitInfo:
    """What the task waits for now, and until when."""

    kind: WaitKind
    #: The durable call that waits: its checkpoint gets the outcome.
    step: str
    occurrence: int
    #: When the wait was registered, or the sleep began.
    since: datetime
    #: A signal's or child's timeout, or the wake time of a sleep (which may have passed: the
    #: task is then due); None: no timeout.
    deadline: datetime | None
    signal_name: str | None = None
    signal_occurrence: int | None = None
    child_id: uuid.UUID | None = None


@dataclass(frozen=True)
class TaskRef:
    """Another task, as a line of a listing: a parent or a child."""

    id: uuid.UUID
    name: str
    version: int
    state: TaskState


@dataclass(frozen=True)
class DurableView:
    """One task's steps, wait, children and parent, as `durable_view` reads them."""

    steps: tuple[StepInfo, ...]
    wait: WaitInfo | None
    children: tuple[TaskRef, ...]
    parent: TaskRef | None
    #: How many older steps and children a limit left out.
    steps_omitted: int = 0
    children_omitted: int = 0


_REF_COLUMNS: Final = (Task.id, Task.name, Task.version, Task.state)


def _ref(row: Any) -> TaskRef:
    return TaskRef(id=row.id, name=row.name, version=row.version, state=row.state)


def _sleep(state: TaskState, run_at: datetime, steps: tuple[StepInfo, ...]) -> WaitInfo | None:
    if not steps:
        return None
    latest = steps[-1]
    wake = sleep_deadline(state, run_at, latest.kind, latest.value)
    if wake is None:
        return None
    return WaitInfo(
        kind="sleep", step=latest.step, occurrence=latest.occurrence, since=latest.created_at,
        deadline=wake,
    )


def newest(
    connection: Connection,
    statement: Select[Unpack[tuple[Any, ...]]],
    order: tuple[Any, ...],
    limit: int | None,
) -> tuple[list[Any], int]:
    """The rows of ``statement`` oldest first by ``order``, and how many older ones were left
    out: with a ``limit``, only the newest ``limit`` (one top-n sort, then one count when
    more exist), so a task with 100,000 of them costs a bounded page to show."""
    if limit is None:
        return list(connection.execute(statement.order_by(*order))), 0
    rows = list(connection.execute(
        statement.order_by(*(column.desc() for column in order)).limit(limit + 1)
    ))
    if len(rows) <= limit:
        return rows[::-1], 0
    total = connection.scalar(
        select(func.count()).select_from(statement.order_by(None).subquery())
    )
    return rows[limit - 1::-1], int(total or 0) - limit


def durable_view(
    connection: Connection,
    task_id: uuid.UUID,
    *,
    state: TaskState,
    run_at: datetime,
    parent_id: uuid.UUID | None,
    steps_limit: int | None = None,
    children_limit: int | None = None,
) -> DurableView:
    """The steps (oldest first), wait, children (oldest first) and parent of one task.

    ``state``, ``run_at`` and ``parent_id`` are the task's, as the caller read them: a sleep
    is told from them and the latest step (see `sleep_deadline`). ``steps_limit`` and
    ``children_limit`` keep only the newest steps and children (None: all). Six ``SELECT``
    statements at most, locking nothing.
    """
    step_rows, steps_omitted = newest(
        connection,
        select(
            Checkpoint.step, Checkpoint.occurrence, Checkpoint.version, Checkpoint.kind,
            Checkpoint.created_at, Checkpoint.value,
        ).where(Checkpoint.task_id == task_id),
        (Checkpoint.created_at, Checkpoint.step, Checkpoint.occurrence),
        steps_limit,
    )
    steps = tuple(
        StepInfo(
            step=r.step, occurrence=r.occurrence, version=r.version, kind=r.kind,
            created_at=r.created_at, value=r.value,
        )
        for r in step_rows
    )
    stored = connection.execute(
        select(
            Wait.kind, Wait.step, Wait.occurrence, Wait.created_at, Wait.timeout_at,
            Wait.signal_name, Wait.signal_occurrence, Wait.child_id,
        ).where(Wait.task_id == task_id)
    ).first()
    wait = _sleep(state, run_at, steps) if stored is None else WaitInfo(
        kind=stored.kind, step=stored.step, occurrence=stored.occurrence,
        since=stored.created_at, deadline=stored.timeout_at, signal_name=stored.signal_name,
        signal_occurrence=stored.signal_occurrence, child_id=stored.child_id,
    )
    child_rows, children_omitted = newest(
        connection,
        select(*_REF_COLUMNS).where(Task.parent_id == task_id),
        (Task.created_at, Task.id),
        children_limit,
    )
    parent = None
    if parent_id is not None:
        # Under READ COMMITTED the parent may have been deleted since the task was read.
        row = connection.execute(select(*_REF_COLUMNS).where(Task.id == parent_id)).first()
        parent = None if row is None else _ref(row)
    return DurableView(
        steps=steps, wait=wait, children=tuple(_ref(r) for r in child_rows), parent=parent,
        steps_omitted=steps_omitted, children_omitted=children_omitted,
    )
