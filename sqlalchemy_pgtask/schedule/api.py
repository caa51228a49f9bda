"""schedule.api: recurring tasks (cron or interval), managed inside the caller's transaction.

::

    set_schedule(session, "nightly-report", task=report, cron="0 3 * * *",
                 timezone="Europe/Berlin", payload={"kind": "daily"})
    session.commit()

Any worker materialises due occurrences (`materialize_schedules`); the task insert and the
cursor advance commit together, and a unique (schedule, occurrence) index makes racing
materialisers harmless. Every function here runs in the caller's session or connection and
never commits; each change writes an audit entry in the same transaction. See
docs/schedules.md.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask._defaults import DEFAULT_QUEUE, TaskTarget
from sqlalchemy_pgtask._prepared import unprepared_async
from sqlalchemy_pgtask.audit import check_actor, check_reason
from sqlalchemy_pgtask.models._operations import MISFIRE_POLICIES, OVERLAP_POLICIES
from sqlalchemy_pgtask.schedule.materialize import (
    MaterializeReport,
    apply_plans,
    lock_due,
    materialize_in,
    plan_due,
)
from sqlalchemy_pgtask.schedule.rows import (
    UPCOMING,
    ScheduleInfo,
    ScheduleNotFound,
    change,
    read,
    run_now,
    write,
)
from sqlalchemy_pgtask.schedule.spec import ScheduleSpec, schedule_spec
from sqlalchemy_pgtask.validation import check_int_range, check_task_name

__all__ = [
    "MISFIRE_POLICIES",
    "OVERLAP_POLICIES",
    "MaterializeReport",
    "ScheduleInfo",
    "ScheduleNotFound",
    "delete_schedule",
    "delete_schedule_async",
    "get_schedule",
    "get_schedule_async",
    "list_schedules",
    "list_schedules_async",
    "materialize_schedules",
    "materialize_schedules_async",
    "pause_schedule",
    "pause_schedule_async",
    "resume_schedule",
    "resume_schedule_async",
    "run_schedule_now",
    "run_schedule_now_async",
    "set_schedule",
    "set_schedule_async",
]


def _spec(
    name: str, task: str | TaskTarget, queue: str | None, version: int | None,
    options: dict[str, Any],
) -> ScheduleSpec:
    if isinstance(task, str):
        task_name, default_queue, default_version = task, DEFAULT_QUEUE, 1
    else:
        task_name, default_queue, default_version = task.name, task.queue, task.version
    return schedule_spec(
        name, task_name=task_name, queue=default_queue if queue is None else queue,
        version=default_version if version is None else version, **options,
    )


def set_schedule(
    bind: SyncBind,
    name: str,
    *,
    task: str | TaskTarget,
    cron: str | None = None,
    every: float | timedelta | None = None,
    timezone: str = "UTC",
    queue: str | None = None,
    version: int | None = None,
    payload: Any = None,
    headers: Mapping[str, Any] | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    timeout: float | timedelta | None = None,
    misfire: str = "latest",
    catch_up_limit: int | None = None,
    overlap: str = "allow",
    start_at: datetime | None = None,
    actor: str | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> ScheduleInfo:
    """Create or change the schedule ``name`` in ``bind``'s transaction; never commits.

    ``cron`` (5 fields, or 6 with seconds first, read in ``timezone``) or ``every`` (seconds
    or a timedelta, at least 1 s). ``queue`` and ``version`` default to the definition's (or
    ``"default"`` and 1 for a task name). ``misfire``: ``"skip"``, ``"latest"`` or
    ``"catch_up"`` (with ``catch_up_limit``, 1 to 10,000); ``overlap``: ``"allow"`` or
    ``"skip"`` (no new task while the previous occurrence's is pending, running or waiting).

    Called again with the same definition, it changes nothing and keeps the cursor; with a
    different one it starts afresh: the cursor becomes the first occurrence at or after
    ``start_at``, or else the next after database now (an interval: now plus the interval).
    ``concurrency_key`` and ``concurrency_limit`` are each occurrence's (see `enqueue`).

    :raises ValidationError: a bad option (cron, time zone, policy ...), before any SQL.
    """
    spec = _spec(name, task, queue, version, dict(
        cron=cron, every=every, timezone=timezone, payload=payload, headers=headers,
        priority=priority, max_attempts=max_attempts, timeout=timeout, misfire=misfire,
        catch_up_limit=catch_up_limit, overlap=overlap, start_at=start_at,
        concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
    ))
    checked = check_actor(actor)
    return write(connection_of(sync_bind(bind, "set_schedule")), spec, checked, False)


async def set_schedule_async(
    bind: AsyncBind,
    name: str,
    *,
    task: str | TaskTarget,
    cron: str | None = None,
    every: float | timedelta | None = None,
    timezone: str = "UTC",
    queue: str | None = None,
    version: int | None = None,
    payload: Any = None,
    headers: Mapping[str, Any] | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    timeout: float | timedelta | None = None,
    misfire: str = "latest",
    catch_up_limit: int | None = None,
    overlap: str = "allow",
    start_at: datetime | None = None,
    actor: str | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> ScheduleInfo:
    """`set_schedule` for an `AsyncSession` or `AsyncConnection`; the same guarantees.

    The options are checked in a thread: finding a cron expression's next occurrence in a
    time zone (or that it has none) is computation the caller's event loop need not wait for.
    """
    target = async_bind(bind, "set_schedule")
    spec = await asyncio.to_thread(_spec, name, task, queue, version, dict(
        cron=cron, every=every, timezone=timezone, payload=payload, headers=headers,
        priority=priority, max_attempts=max_attempts, timeout=timeout, misfire=misfire,
        catch_up_limit=catch_up_limit, overlap=overlap, start_at=start_at,
        concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
    ))
    checked = check_actor(actor)
    connection = await async_connection_of(target)
    return await connection.run_sync(write, spec, checked, False)


def _checked(name: object, actor: object, reason: object) -> tuple[str, str | None, str | None]:
    return check_task_name(name, "name"), check_actor(actor), check_reason(reason)


def pause_schedule(
    bind: SyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> ScheduleInfo:
    """Stop materialising ``name`` (occurrences while paused are skipped); never commits.

    :raises ScheduleNotFound: no such schedule.
    """
    args = _checked(name, actor, reason)
    return change(connection_of(sync_bind(bind, "pause_schedule")), args[0], "schedule.pause",
                   args[1], args[2])


async def pause_schedule_async(
    bind: AsyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> ScheduleInfo:
    """`pause_schedule` for an `AsyncSession` or `AsyncConnection`."""
    args = _checked(name, actor, reason)
    connection = await async_connection_of(async_bind(bind, "pause_schedule"))
    return await connection.run_sync(change, args[0], "schedule.pause", args[1], args[2])


def resume_schedule(
    bind: SyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> ScheduleInfo:
    """Materialise ``name`` again, from its next occurrence after now; never commits.

    :raises ScheduleNotFound: no such schedule.
    """
    args = _checked(name, actor, reason)
    return change(connection_of(sync_bind(bind, "resume_schedule")), args[0],
                   "schedule.resume", args[1], args[2])


async def resume_schedule_async(
    bind: AsyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> ScheduleInfo:
    """`resume_schedule` for an `AsyncSession` or `AsyncConnection`."""
    args = _checked(name, actor, reason)
    connection = await async_connection_of(async_bind(bind, "resume_schedule"))
    return await connection.run_sync(change, args[0], "schedule.resume", args[1], args[2])


def run_schedule_now(
    bind: SyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> uuid.UUID:
    """Enqueue one occurrence of ``name`` now, from its template, in ``bind``'s transaction;
    returns the task's id. Never commits.

    The task is the schedule's (``schedule_name``), its occurrence (``scheduled_for``) database
    now, due at once; it becomes the schedule's last task (so ``overlap="skip"`` waits for it),
    and the cursor does not move: the next occurrence comes as planned. A paused schedule may
    be run this way too, and the overlap policy is not consulted: the caller asked. Writes a
    ``schedule.run_now`` audit entry naming the task in the same transaction.

    The role needs the producer's ``INSERT`` on ``pgtask.tasks``, which the admin level of
    `sqlalchemy_pgtask.grants` does not have: without it the database refuses the insert
    (SQLSTATE 42501) and nothing is written.

    :raises ValidationError: a bad name, ``actor`` or ``reason``, before any SQL.
    :raises ScheduleNotFound: no such schedule.
    :raises QueueFull: the schedule's queue is at capacity; nothing was written.
    """
    args = _checked(name, actor, reason)
    return run_now(connection_of(sync_bind(bind, "run_schedule_now")), *args)


async def run_schedule_now_async(
    bind: AsyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> uuid.UUID:
    """`run_schedule_now` for an `AsyncSession` or `AsyncConnection`."""
    args = _checked(name, actor, reason)
    connection = await async_connection_of(async_bind(bind, "run_schedule_now"))
    return await connection.run_sync(run_now, *args)


def delete_schedule(
    bind: SyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> ScheduleInfo:
    """Delete ``name``; its tasks stay. Returns what it was. Never commits.

    A schedule declared in code comes back at the next worker start unless removed from code.

    :raises ScheduleNotFound: no such schedule.
    """
    args = _checked(name, actor, reason)
    return change(connection_of(sync_bind(bind, "delete_schedule")), args[0],
                   "schedule.delete", args[1], args[2])


async def delete_schedule_async(
    bind: AsyncBind, name: str, *, actor: str | None = None, reason: str | None = None
) -> ScheduleInfo:
    """`delete_schedule` for an `AsyncSession` or `AsyncConnection`."""
    args = _checked(name, actor, reason)
    connection = await async_connection_of(async_bind(bind, "delete_schedule"))
    return await connection.run_sync(change, args[0], "schedule.delete", args[1], args[2])


def list_schedules(bind: SyncBind, *, upcoming: int = 3) -> list[ScheduleInfo]:
    """Every schedule by name, each with its next ``upcoming`` occurrences."""
    check_int_range("upcoming", upcoming, 0, 100)
    return read(connection_of(sync_bind(bind, "list_schedules")), None, upcoming)


async def list_schedules_async(bind: AsyncBind, *, upcoming: int = 3) -> list[ScheduleInfo]:
    """`list_schedules` for an `AsyncSession` or `AsyncConnection`."""
    check_int_range("upcoming", upcoming, 0, 100)
    connection = await async_connection_of(async_bind(bind, "list_schedules"))
    return await connection.run_sync(read, None, upcoming)


def get_schedule(bind: SyncBind, name: str, *, upcoming: int = UPCOMING) -> ScheduleInfo | None:
    """The schedule ``name`` with its next ``upcoming`` occurrences, or None."""
    check_task_name(name, "name")
    check_int_range("upcoming", upcoming, 0, 100)
    found = read(connection_of(sync_bind(bind, "get_schedule")), name, upcoming)
    return found[0] if found else None


async def get_schedule_async(
    bind: AsyncBind, name: str, *, upcoming: int = UPCOMING
) -> ScheduleInfo | None:
    """`get_schedule` for an `AsyncSession` or `AsyncConnection`."""
    check_task_name(name, "name")
    check_int_range("upcoming", upcoming, 0, 100)
    connection = await async_connection_of(async_bind(bind, "get_schedule"))
    found = await connection.run_sync(read, name, upcoming)
    return found[0] if found else None


def _materialize(
    connection: Connection, limit: int, exclude: Sequence[str] = ()
) -> MaterializeReport:
    with translated_errors(connection):
        return materialize_in(connection, limit, exclude)


async def _materialize_async(
    connection: AsyncConnection, limit: int, exclude: Sequence[str] = ()
) -> MaterializeReport:
    # The occurrences are computed in a thread: a cron expression in a time zone can take a
    # while, and the caller's event loop (a worker's renews leases) must not wait for it.
    async with unprepared_async(connection):
        with translated_errors():
            now, rows = await connection.run_sync(lock_due, limit, exclude)
            planned = await asyncio.to_thread(plan_due, rows, now) if rows else []
            return await connection.run_sync(apply_plans, planned, now)


def write_declared(
    connection: Connection, spec: ScheduleSpec, actor: str | None = None
) -> ScheduleInfo:
    """Write one schedule declared in code (``declared`` true) in ``connection``'s
    transaction, keeping the cursor when the definition is unchanged (for the worker)."""
    return write(connection, spec, check_actor(actor), True)


def materialize_schedules(
    bind: Engine | SyncBind, *, limit: int = 100, exclude: Sequence[str] = ()
) -> MaterializeReport:
    """Create the tasks of due occurrences of up to ``limit`` schedules; safe to run anywhere,
    any number of times at once (workers do it on their own).

    With an `Engine`, runs and commits a transaction of its own; with a session or
    connection, joins its transaction and never commits. Use READ COMMITTED (the default).
    Schedules named in ``exclude`` are left alone this time.
    """
    check_int_range("limit", limit, 1, 10_000)
    if isinstance(bind, Engine):
        with bind.begin() as connection:
            return _materialize(connection, limit, tuple(exclude))
    return _materialize(
        connection_of(sync_bind(bind, "materialize_schedules")), limit, tuple(exclude)
    )


async def materialize_schedules_async(
    bind: AsyncEngine | AsyncBind, *, limit: int = 100, exclude: Sequence[str] = ()
) -> MaterializeReport:
    """`materialize_schedules` for an `AsyncEngine`, `AsyncSession` or `AsyncConnection`."""
    check_int_range("limit", limit, 1, 10_000)
    if isinstance(bind, AsyncEngine):
        async with bind.begin() as connection:
            return await _materialize_async(connection, limit, tuple(exclude))
    connection = await async_connection_of(async_bind(bind, "materialize_schedules"))
    return await _materialize_async(connection, limit, tuple(exclude))

