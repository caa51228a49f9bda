"""Capacity under the operations paths: concurrent producers, completions, administrative retry.

A queue with ``max_outstanding_tasks`` admits exactly that many pending + running + waiting
tasks however many producers race, gives the room back when tasks finish, and treats a task
moved back from a final state by `retry` like a new one: refused with `QueueFull` (and
nothing written) when the queue is full, counted when there is room.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import (
    QueueFull,
    Registry,
    TaskContext,
    WorkerOptions,
    cancel,
    configure_queue,
    enqueue,
    list_queues,
)
from sqlalchemy_pgtask.admin import retry
from sqlalchemy_pgtask.models import AuditEntry, Task
from sqlalchemy_pgtask.testing import running_worker
from sqlalchemy_pgtask.testing import wait_until as wait_until_async
from tests.support.tasks import task_row
from tests.support.waiting import PATIENCE

QUEUE = "limited"
CAPACITY = 4
PRODUCERS = 16
OPTIONS = WorkerOptions(lease_duration=1.5, shutdown_grace=2.0, queues=(QUEUE,))


def outstanding(engine: Engine) -> int:
    """The admission counter as `list_queues` reports it (releases not yet folded in netted)."""
    with engine.connect() as connection:
        [settings] = [q for q in list_queues(connection) if q.name == QUEUE]
        return settings.outstanding_tasks


def active_tasks(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(
            select(func.count()).select_from(Task)
            .where(Task.queue == QUEUE, Task.state.in_(["pending", "running", "waiting"]))
        ) or 0)


def audit_count(engine: Engine) -> int:
    """Audit entries of tasks (the queue's configuration has one too)."""
    with engine.connect() as connection:
        return int(connection.scalar(
            select(func.count()).select_from(AuditEntry).where(AuditEntry.task_id.is_not(None))
        ) or 0)


def limit_queue(engine: Engine) -> None:
    with engine.begin() as connection:
        configure_queue(connection, QUEUE, max_outstanding_tasks=CAPACITY)


def produce_concurrently(engine: Engine, count: int) -> list[object]:
    """``count`` threads, each on its own connection, enqueue one task each at once."""
    barrier = threading.Barrier(count)
    outcomes: list[object] = [None] * count
    # One connection per producer, more than the test engine's pool holds.
    producers = create_engine(engine.url, poolclass=NullPool)

    def produce(index: int) -> None:
        with producers.connect() as connection:
            connection.execute(text("SELECT 1"))  # connected before the barrier
            barrier.wait(PATIENCE)
            try:
                outcomes[index] = enqueue(connection, "job", queue=QUEUE).id
                connection.commit()
            except QueueFull as exc:
                outcomes[index] = exc
                connection.rollback()

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    producers.dispose()
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


def registry_for(results: dict[str, Any]) -> Registry:
    registry = Registry()

    @registry.task("job", queue=QUEUE, max_attempts=1)
    async def job(ctx: TaskContext, payload: Any) -> str:
        if payload == "fail":
            raise RuntimeError("asked to fail")
        results[str(ctx.task_id)] = ctx.attempt
        return "done"

    return registry


async def drained(engine: AsyncEngine, task_ids: list[uuid.UUID]) -> None:
    async def finished() -> bool:
        for task_id in task_ids:
            if (await task_row(engine, task_id))["state"] not in ("succeeded", "failed"):
                return False
        return True

    await wait_until_async(finished, PATIENCE, message="the tasks to finish")


def test_sixteen_concurrent_producers_against_capacity_four_create_exactly_four(
    pgtask_engine: Engine,
) -> None:
    limit_queue(pgtask_engine)

    outcomes = produce_concurrently(pgtask_engine, PRODUCERS)

    created = [o for o in outcomes if isinstance(o, uuid.UUID)]
    refused = [o for o in outcomes if isinstance(o, QueueFull)]
    assert (len(created), len(refused)) == (CAPACITY, PRODUCERS - CAPACITY), outcomes
    assert active_tasks(pgtask_engine) == CAPACITY
    assert outstanding(pgtask_engine) == CAPACITY


async def test_the_counter_is_right_after_completions(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    limit_queue(pgtask_engine)
    first = [o for o in produce_concurrently(pgtask_engine, PRODUCERS) if isinstance(o, uuid.UUID)]
    assert len(first) == CAPACITY

    results: dict[str, Any] = {}
    async with running_worker(registry_for(results), pgtask_database_url, OPTIONS):
        await drained(pgtask_async_engine, first)
    assert outstanding(pgtask_engine) == 0
    assert active_tasks(pgtask_engine) == 0

    # The room came back: another race admits exactly CAPACITY again.
    second = produce_concurrently(pgtask_engine, PRODUCERS)
    assert sum(isinstance(o, uuid.UUID) for o in second) == CAPACITY
    assert outstanding(pgtask_engine) == CAPACITY


async def test_administrative_retry_needs_room_and_is_counted(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    limit_queue(pgtask_engine)
    with pgtask_engine.begin() as connection:
        failing = enqueue(connection, "job", "fail", queue=QUEUE).id
    results: dict[str, Any] = {}
    registry = registry_for(results)
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await drained(pgtask_async_engine, [failing])
    assert (await task_row(pgtask_async_engine, failing))["state"] == "failed"
    assert outstanding(pgtask_engine) == 0

    with pgtask_engine.begin() as connection:
        fillers = [enqueue(connection, "job", queue=QUEUE).id for _ in range(CAPACITY)]
    assert outstanding(pgtask_engine) == CAPACITY

    # Full: the retry is refused and writes nothing, not even its audit entry.
    before = await task_row(pgtask_async_engine, failing)
    with pgtask_engine.connect() as connection, pytest.raises(QueueFull) as full:
        retry(connection, failing, actor="ops")
    assert "capacity of 4" in str(full.value)
    assert await task_row(pgtask_async_engine, failing) == before
    assert audit_count(pgtask_engine) == 0
    assert outstanding(pgtask_engine) == CAPACITY

    # Room for one: the retry takes it.
    with pgtask_engine.begin() as connection:
        cancel(connection, fillers[0])
    assert outstanding(pgtask_engine) == CAPACITY - 1
    with pgtask_engine.begin() as connection:
        retry(connection, failing, actor="ops")
    assert outstanding(pgtask_engine) == CAPACITY
    assert active_tasks(pgtask_engine) == CAPACITY
    assert audit_count(pgtask_engine) == 2  # the cancel and the retry

    # And the next producer is refused until the retried task finishes.
    with pgtask_engine.connect() as connection, pytest.raises(QueueFull):
        enqueue(connection, "job", queue=QUEUE)
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await drained(pgtask_async_engine, [failing, *fillers[1:]])
    assert outstanding(pgtask_engine) == 0
    assert active_tasks(pgtask_engine) == 0
