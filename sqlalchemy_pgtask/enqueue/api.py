"""enqueue.api: adds tasks inside the caller's transaction; never commits, never opens a connection.

A task enqueued here exists exactly when the caller's transaction commits: if the business
transaction rolls back, so does the task. Works with a `Session` or a `Connection`, and the
``*_async`` twins with an `AsyncSession` or an `AsyncConnection` (scoped sessions stand for
their current session). Every argument, the bind's kind included, is checked before any SQL
runs, so bad input raises a `ValidationError` (a wrong bind a `TypeError`) and leaves the
caller's transaction untouched and usable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask._defaults import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE
from sqlalchemy_pgtask._driver_sql import execute, execute_async
from sqlalchemy_pgtask._prepared import unprepared, unprepared_async
from sqlalchemy_pgtask.enqueue.copy import copy_rows_async, copy_rows_sync, copyable
from sqlalchemy_pgtask.enqueue.plan import (
    EnqueueRequest,
    EnqueueResult,
    Plan,
    execution,
    plan_many,
    plan_one,
    validate_many,
)

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_QUEUE",
    "EnqueueRequest",
    "EnqueueResult",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]

def _execute(bind: Session | Connection, plan: Plan) -> list[EnqueueResult]:
    connection = connection_of(bind)
    steps = execution(plan)
    with unprepared(connection), translated_errors(idempotent=plan.idempotent):
        statement, params = next(steps)
        while True:
            result = execute(connection, statement, params)
            try:
                statement, params = steps.send(result.all() if result.returns_rows else None)
            except StopIteration as done:
                results: list[EnqueueResult] = done.value
                return results


async def _execute_async(bind: AsyncSession | AsyncConnection, plan: Plan) -> list[EnqueueResult]:
    connection = await async_connection_of(bind)
    steps = execution(plan)
    async with unprepared_async(connection):
        with translated_errors(idempotent=plan.idempotent):
            statement, params = next(steps)
            while True:
                result = await execute_async(connection, statement, params)
                try:
                    statement, params = steps.send(result.all() if result.returns_rows else None)
                except StopIteration as done:
                    results: list[EnqueueResult] = done.value
                    return results


def enqueue(
    bind: SyncBind,
    name: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    version: int = 1,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    idempotency_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    timeout: float | timedelta | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> EnqueueResult:
    """Add a task in ``bind``'s current transaction and return its id.

    The task exists once the caller commits, and never if the caller rolls back: this function
    runs one statement on ``bind`` and neither flushes, commits nor opens a connection.

    :param name: the task name a worker's handler is registered under.
    :param payload: any JSON-serialisable value, at most 1 MiB as JSON.
    :param queue: the queue to add it to.
    :param version: the handler version that must run it.
    :param run_at: the earliest time it may run (timezone-aware, years 1 to 9999 in UTC).
    :param delay: or, instead of ``run_at``, seconds (or a timedelta) from now, where "now" is
        the database's clock, never this process's; at most 100 years.
    :param priority: higher runs first within a queue (-32768 to 32767).
    :param max_attempts: how many failed attempts it gets before it fails for good; by default
        the registered handler's ``max_attempts`` (its worker fills it in at the first claim).
    :param idempotency_key: at most one task per key and queue exists until the key expires;
        a duplicate returns the existing task's id with ``created=False``.
    :param headers: a JSON object of metadata (trace context, correlation ids), at most 64 KiB.
    :param timeout: this task's time limit per attempt (seconds or a timedelta), instead of
        its handler's ``timeout``: past it the attempt is stopped and fails with kind
        ``timeout``, and is retried by policy.
    :param concurrency_key: at most ``concurrency_limit`` tasks of this queue, name and key
        run at once (a durable workflow's suspensions hold the key too, unless its handler
        says ``concurrency_scope="running"``); the others wait their turn, in claim order,
        while other keys' tasks go ahead (docs/concurrency.md). At most 512 bytes.
    :param concurrency_limit: this task's limit for its key, instead of its handler's
        ``concurrency_limit`` (default 1); needs a ``concurrency_key``.
    :raises ValidationError: on bad input, before any SQL runs.
    :raises TypeError: ``bind`` is not a Session or Connection (an engine, or an async session:
        use `enqueue_async`), before any SQL runs.
    :raises QueueFull: the queue is at capacity (SQLSTATE PT001); the transaction is aborted.
    :raises IdempotencyConflict: under REPEATABLE READ or SERIALIZABLE, the key was reserved by
        a transaction committed after this one's snapshot; retry the whole transaction.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    """
    target = sync_bind(bind, "enqueue")
    plan = plan_one(
        name, payload, queue=queue, version=version, run_at=run_at, delay=delay,
        priority=priority, max_attempts=max_attempts, idempotency_key=idempotency_key,
        headers=headers, timeout=timeout, concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
    )
    return _execute(target, plan)[0]


async def enqueue_async(
    bind: AsyncBind,
    name: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    version: int = 1,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    idempotency_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    timeout: float | timedelta | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> EnqueueResult:
    """`enqueue` for an `AsyncSession` or an `AsyncConnection`; the same guarantees."""
    target = async_bind(bind, "enqueue")
    plan = plan_one(
        name, payload, queue=queue, version=version, run_at=run_at, delay=delay,
        priority=priority, max_attempts=max_attempts, idempotency_key=idempotency_key,
        headers=headers, timeout=timeout, concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
    )
    return (await _execute_async(target, plan))[0]


def enqueue_many(bind: SyncBind, requests: Iterable[EnqueueRequest]) -> list[EnqueueResult]:
    """Add many tasks with one statement (one round trip), all or nothing.

    A batch of 100 or more requests without idempotency keys or delays is sent with
    ``COPY`` instead (on psycopg), in the same transaction, with the same triggers: capacity
    is enforced and workers are woken as for the statement.

    Every request is validated before anything is sent; one bad request rejects the batch.
    Results come back in request order. Two requests with the same queue and idempotency key
    yield one task: the later one reports ``created=False``.
    """
    target = sync_bind(bind, "enqueue_many")
    rows = validate_many(requests)
    if not rows:
        return []
    if copyable(rows):
        connection = connection_of(target)
        with unprepared(connection), translated_errors(idempotent=False):
            if copy_rows_sync(connection, rows):
                return [EnqueueResult(row.id, True) for row in rows]
    return _execute(target, plan_many(rows))


async def enqueue_many_async(
    bind: AsyncBind, requests: Iterable[EnqueueRequest]
) -> list[EnqueueResult]:
    """`enqueue_many` for an `AsyncSession` or an `AsyncConnection`."""
    target = async_bind(bind, "enqueue_many")
    rows = validate_many(requests)
    if not rows:
        return []
    if copyable(rows):
        connection = await async_connection_of(target)
        async with unprepared_async(connection):
            with translated_errors(idempotent=False):
                if await copy_rows_async(connection, rows):
                    return [EnqueueResult(row.id, True) for row in rows]
    return await _execute_async(target, plan_many(rows))
