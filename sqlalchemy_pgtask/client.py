"""client: reading, cancelling and awaiting tasks from application code; no handler logic.

`get_task` and `cancel` run in the caller's transaction (and never commit); a cancellation
is audited in it. Administrative retry and queue pause/resume are in `admin`. The waiters open
their own connection, because waiting needs ``LISTEN`` on a connection nobody else uses.
Queue settings live in `queues` (``configure_queue`` is re-exported here for old imports).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from sqlalchemy import Connection, Engine, Select, select
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, joinedload, scoped_session, selectinload

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import first
from sqlalchemy_pgtask._atomic import audited_unit
from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    async_engine,
    async_session,
    connection_of,
    parse_task_id,
    sync_bind,
    sync_engine,
    sync_session,
    translated_errors,
)
from sqlalchemy_pgtask._prepared import unprepared_async
from sqlalchemy_pgtask._result_waiters import subscribed, subscribed_sync
from sqlalchemy_pgtask.audit import audit_statement, check_actor, check_reason
from sqlalchemy_pgtask.errors import TaskNotFound
from sqlalchemy_pgtask.models import TERMINAL_STATES, Task

# Queue settings moved to `queues`; re-exported so existing imports keep working.
from sqlalchemy_pgtask.queues import UNSET, configure_queue
from sqlalchemy_pgtask.validation import check_poll_interval, check_timeout

__all__ = [
    "UNSET",
    "cancel",
    "cancel_async",
    "configure_queue",
    "get_task",
    "get_task_async",
    "wait_for_result",
    "wait_for_result_async",
]

#: How often a waiter re-reads the task even without a notification (a missed one, say).
DEFAULT_POLL_INTERVAL: Final = 1.0


def _with_relations(task_id: uuid.UUID) -> Select[Task]:
    # Collections by a second SELECT each (no row multiplication); the single rows joined.
    # populate_existing: a task already in the session would otherwise keep relations loaded
    # earlier, stale next to the steps and children read now.
    return (
        select(Task)
        .where(Task.id == task_id)
        .options(
            selectinload(Task.steps),
            joinedload(Task.wait),
            selectinload(Task.children),
            joinedload(Task.parent),
        )
        .execution_options(populate_existing=True)
    )


def get_task(session: Session | scoped_session[Any], task_id: uuid.UUID | str) -> Task | None:
    """The task with that id (a mapped `Task` in ``session``), or None.

    It is read in the caller's transaction, with its `~Task.steps`, `~Task.wait`,
    `~Task.children` and `~Task.parent` loaded (three statements at most), so they can be
    read after the session closes. A task already in the session is refreshed, relations
    too, from the database. The children and the parent come without their own relations;
    `Session.refresh` and a commit (with ``expire_on_commit``) unload the relations again.
    Never commits.
    """
    target = sync_session(session, "get_task")
    wanted = parse_task_id(task_id)
    with translated_errors(connection_of(target)):
        return target.scalars(_with_relations(wanted)).unique().one_or_none()


async def get_task_async(
    session: AsyncSession | async_scoped_session[Any], task_id: uuid.UUID | str
) -> Task | None:
    """`get_task` for an `AsyncSession`: the relations are loaded, never lazily fetched."""
    target = async_session(session, "get_task")
    wanted = parse_task_id(task_id)
    async with unprepared_async(await async_connection_of(target)):
        with translated_errors():
            return (await target.scalars(_with_relations(wanted))).unique().one_or_none()


def _cancel_params(task_id: uuid.UUID | str) -> dict[str, uuid.UUID]:
    return {"task_id": parse_task_id(task_id)}


def _cancelled(
    connection: Connection,
    params: dict[str, uuid.UUID],
    actor: str | None,
    reason: str | None,
) -> str | None:
    with audited_unit(connection), translated_errors(connection):
        row = connection.execute(statements.CANCEL, params).first()
        if row is None:
            return None
        if row.changed:
            details = {"previous_state": row.previous_state, "state": row.state}
            connection.execute(audit_statement(
                "task.cancel", actor=actor, reason=reason, task_id=params["task_id"],
                queue=row.queue, details=details,
            ))
    return str(row.state)


def cancel(
    bind: SyncBind,
    task_id: uuid.UUID | str,
    *,
    actor: str | None = None,
    reason: str | None = None,
) -> str | None:
    """Cancel a task in ``bind``'s transaction; returns its state afterwards.

    A pending or waiting task is ``"cancelled"`` at once. A running task stays ``"running"``
    with its cancellation requested: its worker stops the handler within a third of the lease
    and the task ends cancelled; no success or retry is recorded after the request. Returns
    None when the task does not exist or had already finished. Never commits.

    A call that changed the task writes a ``task.cancel`` audit entry in the same transaction,
    naming ``actor`` (default: the database role) and ``reason``; asking again for a running
    task whose cancellation was already requested changes nothing and writes no entry.

    :raises ValidationError: a bad ``task_id``, ``actor`` (1 to 255 bytes) or ``reason`` (at
        most 1000 bytes), before any SQL.
    """
    target = sync_bind(bind, "cancel")
    params = _cancel_params(task_id)
    actor, reason = check_actor(actor), check_reason(reason)
    return _cancelled(connection_of(target), params, actor, reason)


async def cancel_async(
    bind: AsyncBind,
    task_id: uuid.UUID | str,
    *,
    actor: str | None = None,
    reason: str | None = None,
) -> str | None:
    """`cancel` for an `AsyncSession` or `AsyncConnection`."""
    target = async_bind(bind, "cancel")
    params = _cancel_params(task_id)
    actor, reason = check_actor(actor), check_reason(reason)
    connection = await async_connection_of(target)
    return await connection.run_sync(_cancelled, params, actor, reason)


def _finished(session: Session, task_id: uuid.UUID) -> Task | None:
    with translated_errors(connection_of(session)):
        task = session.execute(select(Task).where(Task.id == task_id)).scalar_one_or_none()
    if task is None:
        raise TaskNotFound(f"no task with id {task_id}")
    return task if task.state in TERMINAL_STATES else None


class _Wait:
    """One result wait's checked arguments and its deadline (both waiters' share)."""

    def __init__(self, task_id: object, timeout: object, poll_interval: object) -> None:
        self.task_id = parse_task_id(task_id)
        self.timeout = check_timeout("timeout", timeout)
        self.poll_interval = check_poll_interval("poll_interval", poll_interval)
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout

    def late(self) -> TimeoutError:
        return TimeoutError(f"task {self.task_id} did not finish within {self.timeout} s")

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A read that waited past the deadline for a pooled connection is a late result
        (the documented `TimeoutError`), not the pool's own error: the pool's checkout has a
        timeout of its own, which no waiter can shorten."""
        try:
            yield
        except PoolTimeout as exc:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise self.late() from exc
            raise

    def pause(self) -> float:
        """How long to wait for a notification before the next read.

        :raises TimeoutError: the deadline has passed.
        """
        if self.deadline is None:
            return self.poll_interval
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.late()
        return min(self.poll_interval, left)


def wait_for_result(
    engine: Engine,
    task_id: uuid.UUID | str,
    *,
    timeout: float | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Task:
    """Block until the task is terminal and return it (detached, every column loaded; its
    relations are not: `get_task` reads those).

    Subscribes first, then reads, then waits: a task that finishes between the read and the
    wait still wakes it. Notifications are hints; it re-reads at least every
    ``poll_interval`` seconds, so a lost notification only costs latency. Every waiter of an
    engine shares one listening connection (per event loop for `wait_for_result_async`):
    besides it, a waiter takes a pooled connection only for each read.

    :param timeout: seconds to wait at most; None (or ``inf``) waits for ever.
    :param poll_interval: the longest gap between two reads, in seconds (> 0).
    :raises ValidationError: a bad ``task_id``, ``timeout`` or ``poll_interval``, before
        connecting.
    :raises TimeoutError: the task did not finish within ``timeout`` seconds (or its read
        waited for a pooled connection past them: the pool's own ``pool_timeout`` bounds
        that wait, so a waiter on an exhausted pool may return that much later).
    :raises TaskNotFound: there is no such task.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    :raises TypeError: ``engine`` is not an `Engine` (for an `AsyncEngine`, use
        `wait_for_result_async`).
    """
    engine = sync_engine(engine, "wait_for_result")
    wait = _Wait(task_id, timeout, poll_interval)
    with translated_errors(), subscribed_sync(
        engine, str(wait.task_id), deadline=wait.deadline, late=wait.late
    ) as finished:
        while True:
            finished.clear()  # before the read: a notification during it is not lost
            with wait.reading(), Session(engine, expire_on_commit=False) as session:
                task = _finished(session, wait.task_id)
                if task is not None:
                    session.expunge(task)
                    return task
            finished.wait(wait.pause())


async def wait_for_result_async(
    engine: AsyncEngine,
    task_id: uuid.UUID | str,
    *,
    timeout: float | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Task:
    """`wait_for_result` for an `AsyncEngine`."""
    engine = async_engine(engine, "wait_for_result")
    wait = _Wait(task_id, timeout, poll_interval)
    connecting = max(10.0, wait.poll_interval)
    with translated_errors():
        async with subscribed(
            engine, str(wait.task_id), timeout=connecting, deadline=wait.deadline, late=wait.late
        ) as finished:
            while True:
                finished.clear()  # before the read: a notification during it is not lost
                with wait.reading():
                    async with AsyncSession(engine, expire_on_commit=False) as session:
                        task = await session.run_sync(_finished, wait.task_id)
                        if task is not None:
                            session.expunge(task)
                            return task
                pause = wait.pause()  # before the coroutine: a raise here would orphan it
                await first(finished.wait(), timeout=pause)
