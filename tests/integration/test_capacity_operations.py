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
from sqlalchemy.exc import DBAPIError
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
from sqlalchemy_pgtask._failures import is_serialization_failure
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


def test_a_task_finishing_while_the_limit_is_removed_never_makes_the_count_negative(
    pgtask_engine: Engine,
) -> None:
    # Removing a limit resets the counter and drops the releases it can see; a finisher that
    # commits afterwards leaves its release behind, which list_queues subtracted (-1).
    with pgtask_engine.begin() as connection:
        configure_queue(connection, QUEUE, max_outstanding_tasks=CAPACITY)
        task_id = enqueue(connection, "job", queue=QUEUE).id
    with pgtask_engine.connect() as finisher:
        finisher.begin()
        assert cancel(finisher, task_id) == "cancelled"  # its release is not committed yet
        with pgtask_engine.begin() as connection:
            configure_queue(connection, QUEUE, max_outstanding_tasks=None)
        finisher.commit()
    assert outstanding(pgtask_engine) == 0
    with pgtask_engine.begin() as connection:  # a limit again: recounted, the release dropped
        configure_queue(connection, QUEUE, max_outstanding_tasks=CAPACITY)
    assert outstanding(pgtask_engine) == active_tasks(pgtask_engine) == 0


# -- transactions that keep one snapshot (REPEATABLE READ, SERIALIZABLE) ------------------------


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("queue_row", ["new", "existing"])
def test_a_producer_whose_snapshot_predates_the_limit_must_retry(
    pgtask_engine: Engine, level: str, queue_row: str
) -> None:
    # Its snapshot showed no limit (or no queue): its enqueues were neither counted nor
    # refused, past max_outstanding_tasks, and the counter stayed below the truth for good.
    if queue_row == "existing":
        with pgtask_engine.begin() as connection:
            configure_queue(connection, QUEUE, terminal_retention_seconds=60)
    stale = pgtask_engine.execution_options(isolation_level=level)
    with stale.connect() as producer:
        producer.execute(text("SELECT 1"))  # the snapshot, before the limit
        limit_queue(pgtask_engine)
        with pytest.raises(DBAPIError) as caught:
            enqueue(producer, "job", queue=QUEUE)
        assert is_serialization_failure(caught.value)
        producer.rollback()
        # The retry sees the limit and is counted.
        for _ in range(CAPACITY):
            enqueue(producer, "job", queue=QUEUE)
        producer.commit()
        with pytest.raises(QueueFull):
            enqueue(producer, "job", queue=QUEUE)
        producer.rollback()
    assert active_tasks(pgtask_engine) == outstanding(pgtask_engine) == CAPACITY


def test_a_task_finished_under_a_snapshot_older_than_the_limit_must_retry_too(
    pgtask_engine: Engine,
) -> None:
    # Its release was decided from the queue row of its snapshot (no limit yet): the recount
    # had counted the task, nothing released it, and the empty queue refused every enqueue.
    with pgtask_engine.begin() as connection:
        ids = [enqueue(connection, "job", queue=QUEUE).id for _ in range(2)]
    stale = pgtask_engine.execution_options(isolation_level="REPEATABLE READ")
    with stale.connect() as finisher:
        finisher.execute(text("SELECT 1"))
        with pgtask_engine.begin() as connection:
            configure_queue(connection, QUEUE, max_outstanding_tasks=2)
        assert outstanding(pgtask_engine) == 2
        with pytest.raises(DBAPIError) as caught:
            cancel(finisher, ids[0])
        assert is_serialization_failure(caught.value)
        finisher.rollback()
        for task_id in ids:  # the retry sees the limit and gives the room back
            assert cancel(finisher, task_id) == "cancelled"
        finisher.commit()
    assert active_tasks(pgtask_engine) == outstanding(pgtask_engine) == 0
    with pgtask_engine.begin() as connection:
        for _ in range(2):
            enqueue(connection, "job", queue=QUEUE)
    with pgtask_engine.connect() as connection:  # no release left behind for anyone
        assert connection.scalar(text("SELECT count(*) FROM pgtask.capacity_releases")) == 0


def test_producers_with_one_snapshot_each_share_an_unchanged_queue(
    pgtask_engine: Engine,
) -> None:
    # The check for a queue row created since the snapshot inserts and undoes a row: two
    # producers of a queue without one never collide on it, nor on an unlimited row.
    stale = pgtask_engine.execution_options(isolation_level="REPEATABLE READ")
    with stale.connect() as first, stale.connect() as second:
        enqueue(first, "job", queue="no-row")
        enqueue(second, "job", queue="no-row")
        first.commit()
        second.commit()
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "unlimited", terminal_retention_seconds=60)
    with stale.connect() as first, stale.connect() as second:
        enqueue(first, "job", queue="unlimited")
        enqueue(second, "job", queue="unlimited")
        first.commit()
        second.commit()
    with pgtask_engine.connect() as connection:
        assert [q.name for q in list_queues(connection)] == ["unlimited"]  # no row appeared
        assert connection.scalar(select(func.count()).select_from(Task)) == 4
    # Each queue is checked once per transaction (a probe is a subtransaction). A backend of
    # its own: the statistics it reads include what an earlier transaction left unflushed.
    fresh = create_engine(pgtask_engine.url, poolclass=NullPool)
    try:
        with fresh.execution_options(isolation_level="REPEATABLE READ").connect() as producer:
            for _ in range(100):
                enqueue(producer, "job", queue="busy")
            probes = producer.scalar(text(
                "SELECT n_tup_ins FROM pg_stat_xact_user_tables"
                " WHERE relid = 'pgtask.queues'::regclass"
            ))
            producer.commit()
    finally:
        fresh.dispose()
    assert probes == 1


def test_truncating_the_tasks_empties_every_queue(pgtask_engine: Engine) -> None:
    limit_queue(pgtask_engine)
    with pgtask_engine.begin() as connection:
        for _ in range(CAPACITY):
            enqueue(connection, "job", queue=QUEUE)
    with pgtask_engine.begin() as connection:
        connection.execute(text("TRUNCATE pgtask.tasks CASCADE"))
    assert outstanding(pgtask_engine) == 0
    with pgtask_engine.begin() as connection:
        for _ in range(CAPACITY):
            enqueue(connection, "job", queue=QUEUE)
