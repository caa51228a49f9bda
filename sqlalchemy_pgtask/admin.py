"""admin: an operator's interventions, each audited in the caller's transaction; never commits.

* `retry`: run a failed or cancelled task again, with a fresh budget of failed attempts and
  its history kept;
* `pause_queue` / `resume_queue`: stop and restart claims from a queue.

Cancellation (`sqlalchemy_pgtask.cancel`) and queue settings (`configure_queue`) are audited
the same way. Each function writes its change and its audit entry (`sqlalchemy_pgtask.audit`)
in the caller's transaction (on an AUTOCOMMIT connection, in one of its own that commits
before the call returns, `sqlalchemy_pgtask._atomic`): the entry exists exactly when the
change committed. A refused
call (an unknown task, a task that cannot be retried, a full queue) writes neither. The actor
is free text (1 to 255 bytes), say an operator's login; without one, the database role
making the change is recorded. See docs/admin.md.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Connection

from sqlalchemy_pgtask._atomic import audited_unit
from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    parse_task_id,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask.audit import audit_statement, check_actor, check_reason
from sqlalchemy_pgtask.errors import TaskNotFound, TaskNotRetryable
from sqlalchemy_pgtask.queues import QueueSettings, set_paused
from sqlalchemy_pgtask.statements.admin import RETRY, TASK_STATE
from sqlalchemy_pgtask.states import TaskState
from sqlalchemy_pgtask.validation import check_queue_name

__all__ = [
    "pause_queue",
    "pause_queue_async",
    "resume_queue",
    "resume_queue_async",
    "retry",
    "retry_async",
]


def _retried(
    connection: Connection, task_id: uuid.UUID, actor: str | None, reason: str | None
) -> TaskState:
    params = {"task_id": task_id}
    with audited_unit(connection), translated_errors(connection):
        row = connection.execute(RETRY, params).first()
        if row is None:
            state = connection.execute(TASK_STATE, params).scalar_one_or_none()
            if state is None:
                raise TaskNotFound(f"no task with id {task_id}")
            raise TaskNotRetryable(task_id, state)
        connection.execute(audit_statement(
            "task.retry", actor=actor, reason=reason, task_id=task_id, queue=row.queue,
            details={"previous_state": row.previous_state, "attempt": row.attempt},
        ))
    previous: TaskState = row.previous_state
    return previous


def retry(
    bind: SyncBind,
    task_id: uuid.UUID | str,
    *,
    actor: str | None = None,
    reason: str | None = None,
) -> TaskState:
    """Run a failed or cancelled task again; returns the state it was in.

    In ``bind``'s transaction the task becomes ``pending``, due now, with a fresh budget of
    failed attempts (it may fail ``max_attempts`` times again). Its history stays: the
    attempt rows, and the ``attempt`` counter, which the next claim continues. Result, error,
    lease and cancellation request are cleared. A durable task keeps its checkpoints, so its
    handler replays what is recorded and resumes after it; children cancelled with it stay
    cancelled. Its idempotency key, if the reservation still exists, is live again.

    The task row is locked, so of two concurrent retries one succeeds and the other raises
    `TaskNotRetryable` (READ COMMITTED; under REPEATABLE READ or SERIALIZABLE the second
    gets a serialization failure). A ``task.retry`` audit entry naming ``actor`` (default:
    the database role) and ``reason`` is written in the same transaction. Never commits.

    :raises ValidationError: a bad ``task_id``, ``actor`` (1 to 255 bytes) or ``reason`` (at
        most 1000 bytes), before any SQL.
    :raises TaskNotFound: there is no such task; nothing was written.
    :raises TaskNotRetryable: the task is pending, running, waiting or succeeded; nothing
        was written.
    :raises QueueFull: the task's queue is at capacity (a task leaving a final state needs
        room like a new one); nothing was written and, as with any database error, the
        transaction is aborted: use a savepoint to keep the rest of it.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    """
    target = sync_bind(bind, "retry")
    wanted = parse_task_id(task_id)
    actor, reason = check_actor(actor), check_reason(reason)
    return _retried(connection_of(target), wanted, actor, reason)


async def retry_async(
    bind: AsyncBind,
    task_id: uuid.UUID | str,
    *,
    actor: str | None = None,
    reason: str | None = None,
) -> TaskState:
    """`retry` for an `AsyncSession` or `AsyncConnection`; the same guarantees."""
    target = async_bind(bind, "retry")
    wanted = parse_task_id(task_id)
    actor, reason = check_actor(actor), check_reason(reason)
    connection = await async_connection_of(target)
    return await connection.run_sync(_retried, wanted, actor, reason)


def pause_queue(
    bind: SyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> QueueSettings:
    """Pause a queue in ``bind``'s transaction; returns its settings.

    A paused queue accepts enqueues and workers claim nothing from it; tasks already running
    go on. Writes ``queue.pause`` naming ``actor`` (default: the database role) and
    ``reason``. Pausing a paused queue keeps its first ``paused_at`` and writes nothing. A
    queue without settings gets a row (with the defaults). Never commits.

    :raises ValidationError: a bad name, actor or reason, before any SQL.
    """
    target = sync_bind(bind, "pause_queue")
    check_queue_name(name)
    actor, reason = check_actor(actor), check_reason(reason)
    return set_paused(connection_of(target), name, True, actor, reason)


async def pause_queue_async(
    bind: AsyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> QueueSettings:
    """`pause_queue` for an `AsyncSession` or `AsyncConnection`."""
    target = async_bind(bind, "pause_queue")
    check_queue_name(name)
    actor, reason = check_actor(actor), check_reason(reason)
    connection = await async_connection_of(target)
    return await connection.run_sync(set_paused, name, True, actor, reason)


def resume_queue(
    bind: SyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> QueueSettings:
    """Resume a paused queue in ``bind``'s transaction; returns its settings.

    Idle workers are woken when the transaction commits. Writes ``queue.resume`` (its
    details say since when the queue was paused); resuming a queue that is not paused
    changes and writes nothing. Never commits.

    :raises ValidationError: a bad name, actor or reason, before any SQL.
    """
    target = sync_bind(bind, "resume_queue")
    check_queue_name(name)
    actor, reason = check_actor(actor), check_reason(reason)
    return set_paused(connection_of(target), name, False, actor, reason)


async def resume_queue_async(
    bind: AsyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> QueueSettings:
    """`resume_queue` for an `AsyncSession` or `AsyncConnection`."""
    target = async_bind(bind, "resume_queue")
    check_queue_name(name)
    actor, reason = check_actor(actor), check_reason(reason)
    connection = await async_connection_of(target)
    return await connection.run_sync(set_paused, name, False, actor, reason)
