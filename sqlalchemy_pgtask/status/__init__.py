"""status: read models of workers, queues and tasks for operators; never writes.

Every function takes a SQLAlchemy `Connection`, runs only ``SELECT`` statements in the caller's
transaction, and returns frozen dataclasses, so the ``pgtask`` command (and a dashboard of your
own) prints from typed values rather than from rows. Run them in a read-only transaction if you
like: nothing here needs more.

The one question these answer that the tables alone do not: is there pending work that no
live worker can run (an unknown task name or handler version, or no worker on the queue)?
And its companion, `held_back`: is there work a background pass should have handled by now
(a due wait timeout, an expired lease) and has not?
"""

from __future__ import annotations

from sqlalchemy_pgtask._connection import parse_task_id
from sqlalchemy_pgtask.queues import QueueSettings
from sqlalchemy_pgtask.status._durable import StepInfo, TaskRef, WaitInfo, WaitKind
from sqlalchemy_pgtask.status._held import (
    HELD_BACK_AFTER,
    HELD_BACK_COUNT_MAX,
    HeldBack,
    HeldBackKind,
    held_back,
)
from sqlalchemy_pgtask.status._overview import (
    QueueStatus,
    Unroutable,
    WorkerInfo,
    live_workers,
    queue_status,
    schema_installed,
    unroutable,
)
from sqlalchemy_pgtask.status._tasks import (
    LIST_LIMIT_MAX,
    AttemptInfo,
    TaskDetail,
    TaskSummary,
    check_list_filters,
    list_tasks,
    task_detail,
    task_summary,
)

__all__ = [
    "HELD_BACK_AFTER",
    "HELD_BACK_COUNT_MAX",
    "LIST_LIMIT_MAX",
    "AttemptInfo",
    "HeldBack",
    "HeldBackKind",
    "QueueSettings",
    "QueueStatus",
    "StepInfo",
    "TaskDetail",
    "TaskRef",
    "TaskSummary",
    "Unroutable",
    "WaitInfo",
    "WaitKind",
    "WorkerInfo",
    "check_list_filters",
    "held_back",
    "list_tasks",
    "live_workers",
    "parse_task_id",
    "queue_status",
    "schema_installed",
    "task_detail",
    "task_summary",
    "unroutable",
]
