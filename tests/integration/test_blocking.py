"""A producer's long transaction never blocks the worker, and never leads to two executions.

Issue 6, B1: a business transaction that holds a row the worker needs (the queue row of a
capacity-limited queue, an idempotency key, a task row it cancelled, the tasks table while a
capacity is turned on) for several lease durations. The worker's writes must not queue behind
it (they skip the row, or time out), and the watchdog must stop a handler whose lease could not
be renewed before the lease can expire, so another worker never starts the same task while the
first still runs it. Also issue 6, B9: the capacity counter is right whoever sets a capacity.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Queue,
    QueueFull,
    Registry,
    TaskContext,
    WorkerOptions,
    cancel,
    configure_queue,
    enqueue,
    list_queues,
)
from sqlalchemy_pgtask.testing import drain, running_worker, wait_until
from tests.support.tasks import add, wait_for_state
from tests.support.urls import libpq_url

LEASE = 1.5
FAST = WorkerOptions(lease_duration=LEASE, poll_interval=30.0, concurrency=4)
#: How long the producer's transaction stays open: more than two lease durations.
HOLD = 2.5 * LEASE


def quick_registry() -> Registry:
    registry = Registry()

    @registry.task("quick", queue="limited")
    async def quick(ctx: TaskContext, payload: Any) -> str:
        return "done"

    return registry


# -- the hot path never waits for a producer -------------------------------------------------


async def test_a_completion_never_waits_for_a_producer_holding_its_queue_row(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "limited", max_outstanding_tasks=10)
    task_id = await add(pgtask_async_engine, "quick", queue="limited")
    with Session(pgtask_engine) as producer:
        # Admission locks the limited queue's row until this transaction ends.
        enqueue(producer, "quick", queue="limited")
        async with running_worker(quick_registry(), pgtask_database_url, FAST):
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=HOLD)
        producer.rollback()
    assert row["state"] == "succeeded"


async def test_a_completion_never_waits_for_a_duplicate_enqueue_of_its_key(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "quick", queue="limited", idempotency_key="k")
    with Session(pgtask_engine) as producer:
        # A duplicate: the existing reservation is answered, and not locked.
        assert enqueue(producer, "quick", queue="limited", idempotency_key="k") == (
            task_id, False,
        )
        async with running_worker(quick_registry(), pgtask_database_url, FAST):
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=HOLD)
        producer.rollback()
    assert row["state"] == "succeeded"


# -- never two executions at once ------------------------------------------------------------

_RUNS = """
CREATE TABLE runs (
    run_id uuid PRIMARY KEY,
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    worker_id uuid NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at timestamptz
)
"""

_OVERLAPS = """
SELECT count(*) FROM runs AS a JOIN runs AS b ON a.task_id = b.task_id AND a.run_id < b.run_id
WHERE a.started_at < coalesce(b.ended_at, 'infinity')
  AND b.started_at < coalesce(a.ended_at, 'infinity')
"""


@pytest.fixture
def runs(pgtask_engine: Engine, pgtask_database_url: str) -> str:
    """The ``runs`` table handlers record their executions in; yields a libpq URL to it."""
    with pgtask_engine.begin() as conn:
        conn.execute(text(_RUNS))
    return libpq_url(pgtask_database_url)


def recording_registry(conninfo: str) -> Registry:
    registry = Registry()

    @registry.task("slow")
    async def slow(ctx: TaskContext, payload: dict[str, float]) -> int:
        run_id = uuid.uuid4()
        async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO runs VALUES (%s, %s, %s, %s, clock_timestamp(), NULL)",
                (run_id, ctx.task_id, ctx.attempt, ctx.worker_id),
            )
            try:
                await asyncio.sleep(payload["seconds"])
            finally:  # stopped or not, the end of this execution is recorded
                await conn.execute(
                    "UPDATE runs SET ended_at = clock_timestamp() WHERE run_id = %s", (run_id,)
                )
        return ctx.attempt

    return registry


@pytest.mark.parametrize("holder", ["cancel", "capacity_turned_on"])
async def test_a_long_transaction_over_running_tasks_never_leads_to_two_executions(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    runs: str,
    holder: str,
) -> None:
    registry = recording_registry(runs)
    ids = [await add(pgtask_async_engine, "slow", {"seconds": 2 * LEASE}) for _ in range(4)]

    def running() -> bool:
        with pgtask_engine.connect() as conn:
            return bool(
                conn.execute(text("SELECT count(*) = 4 FROM runs WHERE ended_at IS NULL"))
                .scalar_one()
            )

    async with running_worker(registry, pgtask_database_url, FAST):
        await wait_until(running, 30, message="the first worker to run all four tasks")
        # A second worker, ready to recover whatever lease expires and run it again.
        async with running_worker(registry, pgtask_database_url, FAST):
            with Session(pgtask_engine) as producer:
                if holder == "cancel":
                    assert cancel(producer, ids[0]) == "running"  # holds that task's row
                else:  # the capacity recount locks the tasks table until commit
                    configure_queue(producer, "default", max_outstanding_tasks=100)
                await asyncio.sleep(HOLD)  # the fault's duration: a slow business transaction
                producer.commit()
            rows = [await wait_for_state(pgtask_async_engine, i, timeout=60) for i in ids]
    with pgtask_engine.connect() as conn:
        overlaps = conn.execute(text(_OVERLAPS)).scalar_one()
        executions = conn.execute(text("SELECT count(*) FROM runs")).scalar_one()
    assert overlaps == 0, "two executions of one task ran at the same time"
    assert executions >= 4
    if holder == "cancel":
        assert rows[0]["state"] == "cancelled"
        assert [r["state"] for r in rows[1:]] == ["succeeded"] * 3
    else:
        assert [r["state"] for r in rows] == ["succeeded"] * 4


# -- B9: the capacity counter is right whoever sets a capacity -------------------------------


def test_a_capacity_set_through_the_orm_counts_the_outstanding_tasks(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        enqueue(session, "t", queue="q")
        enqueue(session, "t", queue="q")
        session.commit()
        session.add(Queue(name="q", max_outstanding_tasks=3))  # what docs/enqueue.md shows
        session.commit()
        [settings] = list_queues(session)
        assert settings.outstanding_tasks == 2
        enqueue(session, "t", queue="q")
        session.commit()
        with pytest.raises(QueueFull):
            enqueue(session, "t", queue="q")


def test_a_capacity_set_by_any_writer_outside_read_committed_is_refused(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        enqueue(session, "t", queue="q")
        session.commit()
    repeatable = pgtask_engine.execution_options(isolation_level="REPEATABLE READ")
    with Session(repeatable) as session:
        session.execute(select(1))  # the snapshot is taken here
        session.add(Queue(name="q", max_outstanding_tasks=3))
        with pytest.raises(DBAPIError) as raised:
            session.flush()
    assert getattr(raised.value.orig, "sqlstate", None) == "PT002"
    with Session(pgtask_engine) as session:
        assert session.get(Queue, "q") is None


async def test_finished_tasks_give_their_room_back(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "limited", max_outstanding_tasks=2)
        enqueue(session, "quick", queue="limited")
        enqueue(session, "quick", queue="limited")
        session.commit()
        with pytest.raises(QueueFull):
            enqueue(session, "quick", queue="limited")
    await drain(quick_registry(), pgtask_database_url, FAST)
    with Session(pgtask_engine) as session:
        assert list_queues(session)[0].outstanding_tasks == 0
        enqueue(session, "quick", queue="limited")
        enqueue(session, "quick", queue="limited")
        session.commit()
        [settings] = list_queues(session)
    assert settings.outstanding_tasks == 2


async def test_an_outcome_whose_row_is_held_never_holds_back_the_others(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    release = asyncio.Event()

    @registry.task("gated")
    async def gated(ctx: TaskContext, payload: None) -> str:
        await release.wait()
        return "done"

    held, other = await add(pgtask_async_engine, "gated"), await add(pgtask_async_engine, "gated")

    def both_running() -> bool:
        with pgtask_engine.connect() as conn:
            return bool(conn.execute(
                text("SELECT count(*) = 2 FROM pgtask.tasks WHERE state = 'running'")
            ).scalar_one())

    async with running_worker(registry, pgtask_database_url, FAST):
        await wait_until(both_running, 30, message="both handlers to start")
        with Session(pgtask_engine) as producer:
            assert cancel(producer, held) == "running"  # holds that task's row
            release.set()  # both finish; one outcome must wait for the row, the other not
            row = await wait_for_state(pgtask_async_engine, other, timeout=HOLD)
            producer.commit()
        held_row = await wait_for_state(pgtask_async_engine, held, timeout=60)
    assert row["state"] == "succeeded"
    assert held_row["state"] == "cancelled"  # the success came after the cancel request


def test_creating_or_touching_a_limited_queue_keeps_its_count(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "q", max_outstanding_tasks=3)
        first = enqueue(session, "t", queue="q").id
        enqueue(session, "t", queue="q")
        session.commit()
        session.execute(
            text(
                "UPDATE pgtask.tasks SET state = 'succeeded', completed_at = pgtask.now()"
                " WHERE id = :id"
            ),
            {"id": first},
        )
        session.commit()
        assert list_queues(session)[0].outstanding_tasks == 1
        configure_queue(session, "q")  # an "ensure it exists" upsert with nothing to change
        configure_queue(session, "q", paused=False)
        session.commit()
        assert list_queues(session)[0].outstanding_tasks == 1
        enqueue(session, "t", queue="q")
        enqueue(session, "t", queue="q")
        session.commit()
        with pytest.raises(QueueFull):
            enqueue(session, "t", queue="q")


def test_turning_a_capacity_on_gives_up_rather_than_queue_every_writer_behind_it(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as producer, Session(pgtask_engine) as admin:
        enqueue(producer, "t", queue="q")  # an open transaction that wrote to pgtask.tasks
        with pytest.raises(DBAPIError, match="waited 3 s") as raised:
            configure_queue(admin, "q", max_outstanding_tasks=10)
        assert getattr(raised.value.orig, "sqlstate", None) == "55P03"
        producer.rollback()


def test_a_capacity_may_be_turned_on_under_read_uncommitted(pgtask_engine: Engine) -> None:
    # PostgreSQL runs READ UNCOMMITTED as READ COMMITTED: its statements see the latest commits.
    uncommitted = pgtask_engine.execution_options(isolation_level="READ UNCOMMITTED")
    with Session(uncommitted) as session:
        enqueue(session, "t", queue="q")
        session.commit()
        configure_queue(session, "q", max_outstanding_tasks=3)
        session.commit()
        assert list_queues(session)[0].outstanding_tasks == 1
