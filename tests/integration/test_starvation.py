"""Starvation escape: a queue's ``starvation_timeout_seconds`` lets a pending task that has
been due for longer than that be claimed ahead of higher priorities.

Without it, priority is strict: a steady stream of high-priority work can keep a low-priority
task waiting for ever. With it, the claim first takes the queue's starved tasks (oldest
first, through ``ix_tasks_pending_run_at``), then the rest by priority.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, WorkerOptions, enqueue, statements
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import claim_parameters, wait_for_state
from tests.support.waiting import PATIENCE


def set_starvation_timeout(conn: Connection, queue: str, seconds: float | None) -> None:
    conn.execute(
        text(
            "INSERT INTO pgtask.queues (name, starvation_timeout_seconds) VALUES (:q, :s)"
            " ON CONFLICT (name) DO UPDATE SET starvation_timeout_seconds = :s"
        ),
        {"q": queue, "s": seconds},
    )


def claim_one(conn: Connection, statement: Any) -> uuid.UUID | None:
    params = claim_parameters(worker_id=uuid.uuid4(), lease=30.0, limit=1)
    row = conn.execute(statement, params).first()
    return None if row is None else row.id


def seed(conn: Connection) -> tuple[uuid.UUID, uuid.UUID]:
    """A low-priority task due two minutes ago, and a high-priority one due now."""
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=2)
    low = enqueue(conn, "job", priority=-5, run_at=long_ago).id
    high = enqueue(conn, "job", priority=10).id
    return low, high


def test_without_a_timeout_priority_is_strict(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        low, high = seed(conn)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert claim_one(conn, statements.CLAIM) == high
        assert claim_one(conn, statements.CLAIM) == low


def test_a_task_due_longer_than_the_timeout_is_claimed_ahead_of_higher_priorities(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as conn:
        low, high = seed(conn)
        set_starvation_timeout(conn, "default", 60.0)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert claim_one(conn, statements.CLAIM) is None  # governed: the plain claim abstains
        assert claim_one(conn, statements.CLAIM_GOVERNED) == low
        assert claim_one(conn, statements.CLAIM_GOVERNED) == high


def test_a_task_due_for_less_than_the_timeout_keeps_its_priority(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        low, high = seed(conn)
        set_starvation_timeout(conn, "default", 600.0)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert claim_one(conn, statements.CLAIM_GOVERNED) == high
        assert claim_one(conn, statements.CLAIM_GOVERNED) == low


async def test_a_continuous_high_priority_producer_cannot_starve_a_low_priority_task(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as conn:
        set_starvation_timeout(conn, "default", 1.0)
        low = enqueue(conn, "job", {"low": True}, priority=-10).id
    stop = threading.Event()

    def produce() -> None:
        # Always more high-priority work than the worker can do.
        while not stop.is_set():
            with pgtask_engine.begin() as conn:
                for _ in range(5):
                    enqueue(conn, "job", {}, priority=10)
            time.sleep(0.005)

    registry = Registry()

    @registry.task("job")
    async def job(ctx: Any, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.02)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        options = WorkerOptions(concurrency=1, lease_duration=3.0)
        async with running_worker(registry, pgtask_async_engine, options):
            row = await wait_for_state(pgtask_async_engine, low, ["running", "succeeded"],
                                       timeout=PATIENCE)
    finally:
        stop.set()
        producer.join()
    with pgtask_engine.connect() as conn:
        started = conn.execute(
            text("SELECT started_at FROM pgtask.attempts WHERE task_id = :id"), {"id": low}
        ).scalar_one()
        # When it started, high-priority work due before it was still waiting: only the
        # starvation timeout let it through.
        waiting_high = conn.execute(
            text(
                "SELECT count(*) FROM pgtask.tasks t WHERE t.priority = 10 AND t.run_at < :at"
                " AND coalesce((SELECT min(a.started_at) FROM pgtask.attempts a"
                " WHERE a.task_id = t.id), 'infinity') > :at"
            ),
            {"at": started},
        ).scalar_one()
    assert row["state"] in ("running", "succeeded")
    assert waiting_high > 0
