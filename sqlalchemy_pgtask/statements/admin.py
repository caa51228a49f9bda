"""statements.admin: operators' and applications' writes outside the worker; no I/O."""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import bindparam, case, func, null, or_, select, update
from sqlalchemy.sql.dml import ReturningUpdate

from sqlalchemy_pgtask.statements._common import CANCELLED_ERROR, NOW, UUID_T, tasks
from sqlalchemy_pgtask.states import (
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    WAITING,
)

__all__ = ["CANCEL", "RETRY", "RETRYABLE_STATES", "SCHEMA_INSTALLED", "TASK_STATE"]

#: The states an administrative retry accepts. A succeeded task never runs again.
RETRYABLE_STATES: Final = (FAILED, CANCELLED)


def _locked(states: tuple[str, ...]) -> Any:
    """The task ``task_id`` as it is now, locked ``FOR NO KEY UPDATE``, if in ``states``.

    In a READ COMMITTED transaction the lock waits for a concurrent writer and then reads the
    row it committed, re-checking the state: of two racing callers, the second sees the
    first one's result. A task in another state is not locked.
    """
    return (
        select(tasks.c.id, tasks.c.state, tasks.c.cancel_requested_at)
        .where(tasks.c.id == bindparam("task_id", type_=UUID_T), tasks.c.state.in_(states))
        .with_for_update(key_share=True)  # FOR NO KEY UPDATE
        .subquery("before")
    )


def _cancel() -> ReturningUpdate[Any]:
    before = _locked(ACTIVE_STATES)
    at_rest = tasks.c.state.in_([PENDING, WAITING])
    # Whether the call changes anything: a running task whose cancellation was requested
    # already gets no second request (the first one's time is kept).
    changed = or_(before.c.state != RUNNING, before.c.cancel_requested_at.is_(None))
    # The statement's time may precede the change it waited for: an attempt that suspended
    # while this statement waited for the row finished after that time. The task's times
    # never go back, so no attempt finishes after its task completed.
    at = func.greatest(NOW, tasks.c.updated_at)
    return (
        update(tasks)
        .where(tasks.c.id == before.c.id, tasks.c.state.in_(ACTIVE_STATES))
        .values(
            state=case((at_rest, CANCELLED), else_=tasks.c.state),
            cancel_requested_at=func.coalesce(tasks.c.cancel_requested_at, at),
            completed_at=case((at_rest, at), else_=tasks.c.completed_at),
            error=case((at_rest, CANCELLED_ERROR), else_=tasks.c.error),
            updated_at=at,
        )
        .returning(
            tasks.c.state,
            tasks.c.queue,
            before.c.state.label("previous_state"),
            changed.label("changed"),
        )
    )


#: Cancels one task: a pending or waiting task becomes cancelled at once; for a running task
#: the request is recorded, its worker stops the handler at its next lease renewal, and the
#: task ends cancelled (no later success or retry is recorded). Its times are database time,
#: never earlier than the task's last change (``updated_at``). Locks the task row first
#: (``FOR NO KEY UPDATE``, then the update). Returns ``(state, queue, previous_state,
#: changed)``: the task's state after the call, and whether the call changed anything (false
#: for a running task whose cancellation was already requested); or no row when the task is
#: unknown or already finished.
CANCEL: Final = _cancel()


def _retry() -> ReturningUpdate[Any]:
    before = _locked(RETRYABLE_STATES)
    return (
        update(tasks)
        .where(tasks.c.id == before.c.id, tasks.c.state.in_(RETRYABLE_STATES))
        .values(
            state=PENDING,
            run_at=NOW,
            failed_attempts=0,
            result=null(),
            error=null(),
            lease_token=null(),
            lease_owner=null(),
            lease_expires_at=null(),
            cancel_requested_at=null(),
            completed_at=null(),
            updated_at=NOW,
        )
        .returning(tasks.c.queue, tasks.c.attempt, before.c.state.label("previous_state"))
    )


#: An administrative retry: a failed or cancelled task becomes pending, due now, with a fresh
#: budget of failed attempts (``failed_attempts = 0``); its ``attempt`` counter, its attempt
#: rows and its checkpoints are kept. Result, error, lease and cancellation request are
#: cleared. Locks the task row first (``FOR NO KEY UPDATE``), so of two concurrent retries one
#: changes the task and the other finds it pending. Leaving a terminal state needs capacity:
#: a trigger admits it like a new task (SQLSTATE PT001 when the queue is full). Binds
#: ``task_id``; returns ``(queue, attempt, previous_state)``, or no row when the task is
#: unknown or not failed or cancelled.
RETRY: Final = _retry()

#: The state of task ``task_id`` (no lock), or no row: why a retry found nothing to change.
TASK_STATE: Final = select(tasks.c.state).where(tasks.c.id == bindparam("task_id", type_=UUID_T))

#: Whether the pgtask schema is installed in the connected database (true or false).
SCHEMA_INSTALLED: Final = select(func.to_regclass("pgtask.tasks").is_not(None))
