"""statements.admin: operators' and applications' writes outside the worker; no I/O."""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import bindparam, case, func, select, update
from sqlalchemy.sql.dml import ReturningUpdate

from sqlalchemy_pgtask.statements._common import CANCELLED_ERROR, NOW, UUID_T, tasks
from sqlalchemy_pgtask.states import ACTIVE_STATES, CANCELLED, PENDING, WAITING

__all__ = ["CANCEL", "SCHEMA_INSTALLED"]


def _cancel() -> ReturningUpdate[Any]:
    at_rest = tasks.c.state.in_([PENDING, WAITING])
    return (
        update(tasks)
        .where(
            tasks.c.id == bindparam("task_id", type_=UUID_T),
            tasks.c.state.in_(ACTIVE_STATES),
        )
        .values(
            state=case((at_rest, CANCELLED), else_=tasks.c.state),
            cancel_requested_at=func.coalesce(tasks.c.cancel_requested_at, NOW),
            completed_at=case((at_rest, NOW), else_=tasks.c.completed_at),
            error=case((at_rest, CANCELLED_ERROR), else_=tasks.c.error),
            updated_at=NOW,
        )
        .returning(tasks.c.state)
    )


#: Cancels one task: a pending or waiting task becomes cancelled at once; for a running task
#: the request is recorded, its worker stops the handler at its next lease renewal, and the
#: task ends cancelled (no later success or retry is recorded). Locks the task row. Returns the
#: task's state after the call, or no row when the task is unknown or already finished.
CANCEL: Final = _cancel()

#: Whether the pgtask schema is installed in the connected database (true or false).
SCHEMA_INSTALLED: Final = select(func.to_regclass("pgtask.tasks").is_not(None))
