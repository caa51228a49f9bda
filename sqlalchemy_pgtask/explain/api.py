"""explain.api: why a task is not running now, in plain words, from the database alone; never
writes, never locks.

`explain` reads the task and what it depends on (its queue's pause and rate limit, the live
workers and the handler versions they registered, its wait, its lease) in the caller's
transaction, with ``SELECT`` statements only (no ``FOR UPDATE``: a look must not hold up a
claim), and returns an `Explanation`: the task's state and its `Reason` s, each with a stable
``code`` for programs and a sentence for people. Several reasons may hold at once: a task can
be not due yet *and* in a paused queue *and* have no live worker able to run it. All times
are database time (``pgtask.now()``), the clock every deadline is kept in.

The codes, and what to do about each, are in docs/explain.md:

===================  ==============================================================
``not_due``          its ``run_at`` (a delay, or a retry's backoff) is in the future
``sleeping``         a durable sleep until its wake time
``queue_paused``     its queue is paused
``no_live_worker``   no live, non-draining worker has its (name, version) for its queue
``rate_limited``     its queue's rate limit has no start left now
``workers_busy``     every live worker able to run it has all its slots taken
``concurrency_key``  its concurrency key is held by its limit of tasks, or earlier tasks
                     of the key take the free places first
``ready``            due, and nothing holds it back: the next claim takes it
``waiting_signal``   waiting for a signal
``waiting_child``    waiting for a child task to finish
``waiting``          waiting, but no wait is recorded (never in one snapshot)
``running``          running on a worker, with a lease until a time
``terminal``         succeeded, failed or cancelled, and why
===================  ==============================================================

Run it in a ``REPEATABLE READ`` transaction for one consistent snapshot (``pgtask task
explain`` does): it reads with several statements.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Connection

from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_connection_of,
    connection_of,
    parse_task_id,
    translated_errors,
)
from sqlalchemy_pgtask.errors import TaskNotFound
from sqlalchemy_pgtask.explain.facts import LatestStep, StepReader, read_facts
from sqlalchemy_pgtask.explain.keyed import key_reason, read_key
from sqlalchemy_pgtask.explain.reasons import (
    REASON_CODES,
    Explanation,
    Reason,
    ReasonCode,
    WorkerSlots,
    reasons_of,
)
from sqlalchemy_pgtask.states import PENDING

__all__ = [
    "REASON_CODES",
    "Explanation",
    "Reason",
    "ReasonCode",
    "WorkerSlots",
    "explain",
    "explain_async",
]


def _explained(
    connection: Connection, task_id: uuid.UUID, latest_step: StepReader | None = None
) -> Explanation:
    with translated_errors(connection):
        facts = read_facts(connection, task_id, latest_step)
        if facts is None:
            raise TaskNotFound(f"no task with id {task_id}")
        task = facts.task
        key = read_key(connection, task) if task.state == PENDING else None
    reasons = reasons_of(facts)
    waits_for_key = key_reason(facts, key)
    if waits_for_key is not None:  # the next claim passes it over: it is not ready
        reasons = (*(r for r in reasons if r.code != "ready"), waits_for_key)
    return Explanation(
        task_id=task.id, queue=task.queue, name=task.name, version=task.version,
        state=task.state, now=facts.now, reasons=reasons,
    )


def explain(bind: SyncBind, task_id: uuid.UUID | str) -> Explanation:
    """Why the task ``task_id`` is not running now (or, if it is, where and until when).

    Reads in ``bind``'s transaction (a `Session`, `Connection` or ``scoped_session``),
    without flushing the session, writing or locking anything. Never commits.

    :raises ValidationError: ``task_id`` is not a UUID, before any SQL.
    :raises TaskNotFound: there is no such task.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    """
    wanted = parse_task_id(task_id)
    return _explained(connection_of(bind, "explain"), wanted)


def explain_knowing_latest_step(
    connection: Connection, task_id: uuid.UUID, latest_step: LatestStep
) -> Explanation:
    """`explain` for a caller that read the task's newest checkpoint (``(step, kind, value)``,
    None if it has none) in the same snapshot: the dashboard's task page, whose steps list
    holds it, saves a second read of every checkpoint of a long workflow (no index orders
    them by time). Not exported: the caller must guarantee the snapshot."""
    return _explained(connection, task_id, lambda _connection, _task: latest_step)


async def explain_async(bind: AsyncBind, task_id: uuid.UUID | str) -> Explanation:
    """`explain` for an `AsyncSession` or `AsyncConnection`; the same guarantees."""
    wanted = parse_task_id(task_id)
    connection = await async_connection_of(bind, "explain")
    return await connection.run_sync(_explained, wanted)
