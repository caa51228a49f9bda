"""client: reading, cancelling and awaiting tasks from application code; no handler logic.

`get_task` and `cancel` run in the caller's transaction (and never commit). The waiters open
their own connection, because waiting needs ``LISTEN`` on a connection nobody else uses.
"""

from __future__ import annotations

import time
import uuid
from typing import Final

import psycopg
from sqlalchemy import Engine, make_url, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.enqueue import AsyncBind, SyncBind
from sqlalchemy_pgtask.errors import InvalidOptionError, TaskNotFound
from sqlalchemy_pgtask.models import TERMINAL_STATES, Task

__all__ = [
    "cancel",
    "cancel_async",
    "get_task",
    "get_task_async",
    "wait_for_result",
    "wait_for_result_async",
]

RESULT_CHANNEL: Final = "pgtask_result"
#: How often a waiter re-reads the task even without a notification (a missed one, say).
DEFAULT_POLL_INTERVAL: Final = 1.0


def _task_id(value: uuid.UUID | str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError as exc:
        raise InvalidOptionError("task_id", f"{value!r} is not a UUID") from exc


def get_task(session: Session, task_id: uuid.UUID | str) -> Task | None:
    """The task with that id (a mapped `Task` in ``session``), or None."""
    return session.get(Task, _task_id(task_id))


async def get_task_async(session: AsyncSession, task_id: uuid.UUID | str) -> Task | None:
    """`get_task` for an `AsyncSession`."""
    return await session.get(Task, _task_id(task_id))


def _cancel_params(task_id: uuid.UUID | str) -> dict[str, uuid.UUID]:
    return {"task_id": _task_id(task_id)}


def cancel(bind: SyncBind, task_id: uuid.UUID | str) -> str | None:
    """Cancel a task in ``bind``'s transaction; returns its state afterwards.

    A pending or waiting task is ``"cancelled"`` at once. A running task stays ``"running"``
    with its cancellation requested: its worker stops the handler within a third of the lease
    and the task ends cancelled; no success or retry is recorded after the request. Returns
    None when the task does not exist or had already finished. Never commits.
    """
    connection = bind.connection() if isinstance(bind, Session) else bind
    row = connection.execute(statements.CANCEL, _cancel_params(task_id)).first()
    return None if row is None else str(row.state)


async def cancel_async(bind: AsyncBind, task_id: uuid.UUID | str) -> str | None:
    """`cancel` for an `AsyncSession` or `AsyncConnection`."""
    connection: AsyncConnection = (
        await bind.connection() if isinstance(bind, AsyncSession) else bind
    )
    row = (await connection.execute(statements.CANCEL, _cancel_params(task_id))).first()
    return None if row is None else str(row.state)


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _finished(session: Session, task_id: uuid.UUID) -> Task | None:
    task = session.execute(select(Task).where(Task.id == task_id)).scalar_one_or_none()
    if task is None:
        raise TaskNotFound(f"no task with id {task_id}")
    return task if task.state in TERMINAL_STATES else None


def wait_for_result(
    engine: Engine,
    task_id: uuid.UUID | str,
    *,
    timeout: float | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Task:
    """Block until the task is terminal and return it (detached, fully loaded).

    Subscribes first, then reads, then waits: a task that finishes between the read and the
    wait still wakes it. Notifications are hints; it re-reads at least every
    ``poll_interval`` seconds, so a lost notification only costs latency.

    :raises TimeoutError: the task did not finish within ``timeout`` seconds.
    :raises TaskNotFound: there is no such task.
    """
    wanted = _task_id(task_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    url = engine.url.render_as_string(hide_password=False)
    with psycopg.connect(_conninfo(url), autocommit=True) as listener:
        listener.execute(f"LISTEN {RESULT_CHANNEL}")
        while True:
            with Session(engine, expire_on_commit=False) as session:
                task = _finished(session, wanted)
                if task is not None:
                    session.expunge(task)
                    return task
            wait = poll_interval
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"task {wanted} did not finish within {timeout} s")
            for notification in listener.notifies(timeout=wait):
                if notification.payload == str(wanted):
                    break


async def wait_for_result_async(
    engine: AsyncEngine,
    task_id: uuid.UUID | str,
    *,
    timeout: float | None = None,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Task:
    """`wait_for_result` for an `AsyncEngine`."""
    wanted = _task_id(task_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    url = engine.url.render_as_string(hide_password=False)
    listener = await psycopg.AsyncConnection.connect(_conninfo(url), autocommit=True)
    async with listener:
        await listener.execute(f"LISTEN {RESULT_CHANNEL}")
        while True:
            async with AsyncSession(engine, expire_on_commit=False) as session:
                task = await session.run_sync(_finished, wanted)
                if task is not None:
                    session.expunge(task)
                    return task
            wait = poll_interval
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"task {wanted} did not finish within {timeout} s")
            async for notification in listener.notifies(timeout=wait):
                if notification.payload == str(wanted):
                    break
