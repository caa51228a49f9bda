"""enqueue: adds tasks inside the caller's transaction; never commits, never opens a connection.

A task enqueued here exists exactly when the caller's transaction commits: if the business
transaction rolls back, so does the task. Works with a `Session` or a `Connection`, and the
``*_async`` twins with an `AsyncSession` or an `AsyncConnection` (scoped sessions stand for
their current session). Every argument, the bind's kind included, is checked before any SQL
runs, so bad input raises a `ValidationError` (a wrong bind a `TypeError`) and leaves the
caller's transaction untouched and usable.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple

from sqlalchemy import Connection, Executable
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.validation import (
    INT2_MAX,
    INT2_MIN,
    INT4_MAX,
    PAYLOAD_MAX_BYTES,
    check_delay,
    check_idempotency_key,
    check_int_range,
    check_queue_name,
    check_run_at,
    check_task_name,
    dump_headers,
    dump_json,
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

DEFAULT_QUEUE: Final = "default"
DEFAULT_MAX_ATTEMPTS: Final = 5


class EnqueueResult(NamedTuple):
    """What `enqueue` did: the task's id, and whether this call created it.

    ``created`` is False only for an idempotency key that was already reserved; ``id`` is then
    the id of the task that holds the reservation.
    """

    id: uuid.UUID
    created: bool


@dataclass(frozen=True, kw_only=True)
class EnqueueRequest:
    """One task for `enqueue_many`; the fields mean what `enqueue`'s arguments mean."""

    name: str
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    version: int = 1
    run_at: datetime | None = None
    delay: float | timedelta | None = None
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    idempotency_key: str | None = None
    headers: Mapping[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True, slots=True)
class _Row:
    """A validated request, ready to bind: JSON already serialised, ids already generated."""

    id: uuid.UUID
    queue: str
    name: str
    version: int
    payload: str
    headers: str
    priority: int
    max_attempts: int
    run_at: datetime | None
    delay: float
    key: str | None


def _uuid7s(count: int) -> list[uuid.UUID]:
    """Time-ordered UUIDs (RFC 9562 version 7), with one read of randomness for the batch.

    New ids land at the right edge of the primary-key index instead of at random pages, which
    keeps bulk enqueues cache-friendly. The clock only orders ids; no deadline uses it.
    """
    stamp = (time.time_ns() // 1_000_000 & ((1 << 48) - 1)) << 80 | 0x7 << 76 | 0b10 << 62
    randomness = os.urandom(10 * count)
    ids = []
    for offset in range(0, 10 * count, 10):
        rand = int.from_bytes(randomness[offset : offset + 10], "big")
        ids.append(uuid.UUID(int=stamp | ((rand >> 62) & 0xFFF) << 64 | rand & ((1 << 62) - 1)))
    return ids


def _validate(request: EnqueueRequest, task_id: uuid.UUID, prefix: str = "") -> _Row:
    def where(name: str) -> str:
        return f"{prefix}{name}"

    name = check_task_name(request.name, where("name"))
    queue = check_queue_name(request.queue, where("queue"))
    version = check_int_range(where("version"), request.version, 1, INT4_MAX)
    priority = check_int_range(where("priority"), request.priority, INT2_MIN, INT2_MAX)
    max_attempts = check_int_range(where("max_attempts"), request.max_attempts, 1, INT4_MAX)
    key = (
        None
        if request.idempotency_key is None
        else check_idempotency_key(request.idempotency_key, where("idempotency_key"))
    )
    if request.run_at is not None and request.delay is not None:
        raise InvalidOptionError(where("run_at"), "give either run_at or delay, not both")
    run_at = None if request.run_at is None else check_run_at(where("run_at"), request.run_at)
    seconds = 0.0 if request.delay is None else check_delay(where("delay"), request.delay)
    return _Row(
        id=task_id,
        queue=queue,
        name=name,
        version=version,
        payload=dump_json(where("payload"), request.payload, PAYLOAD_MAX_BYTES),
        headers=dump_headers(request.headers, where("headers")),
        priority=priority,
        max_attempts=max_attempts,
        run_at=run_at,
        delay=seconds,
        key=key,
    )


class _Plan(NamedTuple):
    """The one statement to run, its parameters, and how to turn its rows into results."""

    statement: Executable
    params: dict[str, Any]
    rows: list[_Row]
    #: For each request, the index of the request whose result it shares (itself, or the first
    #: request in the batch with the same queue and idempotency key).
    owners: list[int]
    returns_rows: bool

    @property
    def idempotent(self) -> bool:
        """Whether the statement reserves idempotency keys."""
        return self.statement is statements.ENQUEUE_BATCH_IDEMPOTENT


def _plan_row(row: _Row) -> _Plan:
    if row.key is None:
        params = {
            "id": row.id, "queue": row.queue, "name": row.name, "version": row.version,
            "payload": row.payload, "headers": row.headers, "priority": row.priority,
            "max_attempts": row.max_attempts, "run_at": row.run_at, "delay": row.delay,
        }
        return _Plan(statements.ENQUEUE_ONE, params, [row], [0], returns_rows=False)
    return _plan_many([row])


def _plan_many(rows: list[_Row]) -> _Plan:
    owners: list[int] = []
    first_of_key: dict[tuple[str, str], int] = {}
    unique: list[_Row] = []
    ords: list[int] = []
    for index, row in enumerate(rows):
        if row.key is not None:
            slot = first_of_key.setdefault((row.queue, row.key), index)
            if slot != index:
                # ON CONFLICT cannot touch one row twice in a statement: later duplicates of a
                # key in the same batch share the first one's result instead.
                owners.append(slot)
                continue
        owners.append(index)
        unique.append(row)
        ords.append(index)
    first = rows[0]
    shared = (first.queue, first.name, first.version, first.headers, first.priority,
              first.max_attempts, first.run_at, first.delay)
    if not first_of_key and all(
        (row.queue, row.name, row.version, row.headers, row.priority, row.max_attempts,
         row.run_at, row.delay) == shared
        for row in rows
    ):
        uniform = {
            "ids": [row.id for row in rows],
            "payloads": [row.payload for row in rows],
            "queue": first.queue, "name": first.name, "version": first.version,
            "headers": first.headers, "priority": first.priority,
            "max_attempts": first.max_attempts, "run_at": first.run_at, "delay": first.delay,
        }
        return _Plan(statements.ENQUEUE_UNIFORM, uniform, rows, owners, returns_rows=False)
    params = {
        "ords": ords,
        "ids": [row.id for row in unique],
        "queues": [row.queue for row in unique],
        "names": [row.name for row in unique],
        "versions": [row.version for row in unique],
        "payloads": [row.payload for row in unique],
        "headers": [row.headers for row in unique],
        "priorities": [row.priority for row in unique],
        "max_attempts": [row.max_attempts for row in unique],
        "run_ats": [row.run_at for row in unique],
        "delays": [row.delay for row in unique],
        "keys": [row.key for row in unique],
    }
    if first_of_key:
        return _Plan(statements.ENQUEUE_BATCH_IDEMPOTENT, params, rows, owners, returns_rows=True)
    return _Plan(statements.ENQUEUE_BATCH, params, rows, owners, returns_rows=False)


def _results(plan: _Plan, returned: Sequence[Any] | None) -> list[EnqueueResult]:
    by_index: dict[int, EnqueueResult] = {}
    if returned is None:
        by_index = {i: EnqueueResult(row.id, True) for i, row in enumerate(plan.rows)}
    else:
        by_index = {int(r.ord): EnqueueResult(r.id, bool(r.created)) for r in returned}
    results = []
    for index, owner in enumerate(plan.owners):
        result = by_index[owner]
        results.append(result if owner == index else EnqueueResult(result.id, False))
    return results


def _plan_one(
    name: str,
    payload: Any,
    *,
    queue: str,
    version: int,
    run_at: datetime | None,
    delay: float | timedelta | None,
    priority: int,
    max_attempts: int,
    idempotency_key: str | None,
    headers: Mapping[str, Any] | None,
) -> _Plan:
    """Validate one enqueue's arguments and plan its statement."""
    request = EnqueueRequest(
        name=name, payload=payload, queue=queue, version=version, run_at=run_at, delay=delay,
        priority=priority, max_attempts=max_attempts, idempotency_key=idempotency_key,
        headers=headers,
    )
    return _plan_row(_validate(request, _uuid7s(1)[0]))


def _validate_many(requests: Iterable[EnqueueRequest]) -> list[_Row]:
    batch = list(requests)
    ids = _uuid7s(len(batch))
    rows = []
    for index, request in enumerate(batch):
        if not isinstance(request, EnqueueRequest):
            raise InvalidOptionError(
                f"[{index}]", f"must be an EnqueueRequest, got {type(request).__name__}"
            )
        rows.append(_validate(request, ids[index], f"[{index}]."))
    return rows


def _execute(bind: Session | Connection, plan: _Plan) -> list[EnqueueResult]:
    with translated_errors(idempotent=plan.idempotent):
        result = connection_of(bind).execute(plan.statement, plan.params)
        return _results(plan, result.all() if plan.returns_rows else None)


async def _execute_async(
    bind: AsyncSession | AsyncConnection, plan: _Plan
) -> list[EnqueueResult]:
    with translated_errors(idempotent=plan.idempotent):
        result = await (await async_connection_of(bind)).execute(plan.statement, plan.params)
        return _results(plan, result.all() if plan.returns_rows else None)


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
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    idempotency_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
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
    :param max_attempts: how many failed attempts it gets before it fails for good.
    :param idempotency_key: at most one task per key and queue exists until the key expires;
        a duplicate returns the existing task's id with ``created=False``.
    :param headers: a JSON object of metadata (trace context, correlation ids), at most 64 KiB.
    :raises ValidationError: on bad input, before any SQL runs.
    :raises TypeError: ``bind`` is not a Session or Connection (an engine, or an async session:
        use `enqueue_async`), before any SQL runs.
    :raises QueueFull: the queue is at capacity (SQLSTATE PT001); the transaction is aborted.
    :raises IdempotencyConflict: under REPEATABLE READ or SERIALIZABLE, the key was reserved by
        a transaction committed after this one's snapshot; retry the whole transaction.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    """
    target = sync_bind(bind, "enqueue")
    plan = _plan_one(
        name, payload, queue=queue, version=version, run_at=run_at, delay=delay,
        priority=priority, max_attempts=max_attempts, idempotency_key=idempotency_key,
        headers=headers,
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
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    idempotency_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> EnqueueResult:
    """`enqueue` for an `AsyncSession` or an `AsyncConnection`; the same guarantees."""
    target = async_bind(bind, "enqueue")
    plan = _plan_one(
        name, payload, queue=queue, version=version, run_at=run_at, delay=delay,
        priority=priority, max_attempts=max_attempts, idempotency_key=idempotency_key,
        headers=headers,
    )
    return (await _execute_async(target, plan))[0]


def enqueue_many(bind: SyncBind, requests: Iterable[EnqueueRequest]) -> list[EnqueueResult]:
    """Add many tasks with one statement (one round trip), all or nothing.

    Every request is validated before anything is sent; one bad request rejects the batch.
    Results come back in request order. Two requests with the same queue and idempotency key
    yield one task: the later one reports ``created=False``.
    """
    target = sync_bind(bind, "enqueue_many")
    rows = _validate_many(requests)
    if not rows:
        return []
    return _execute(target, _plan_many(rows))


async def enqueue_many_async(
    bind: AsyncBind, requests: Iterable[EnqueueRequest]
) -> list[EnqueueResult]:
    """`enqueue_many` for an `AsyncSession` or an `AsyncConnection`."""
    target = async_bind(bind, "enqueue_many")
    rows = _validate_many(requests)
    if not rows:
        return []
    return await _execute_async(target, _plan_many(rows))
