"""Per-queue rate limits: at most N task starts per period, enforced by the claim itself.

The plain claim never serves a governed queue (a rate limit or a starvation timeout), so a
limit set at any moment holds at once; the governed claim locks the queue's token bucket,
takes at most its whole tokens and spends them. A rate-limited queue takes nothing from the
share of the worker's other queues, and an idle worker waits for the next token rather than
spinning.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    Registry,
    RetryPolicy,
    WorkerOptions,
    enqueue_many,
    statements,
)
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import claim_parameters
from tests.support.waiting import PATIENCE

HOUR = 3600.0


def govern(conn: Connection, queue: str, *, limit: int | None, period: float | None) -> None:
    conn.execute(
        text(
            "INSERT INTO pgtask.queues (name, rate_limit, rate_period_seconds)"
            " VALUES (:q, :limit, :period) ON CONFLICT (name) DO UPDATE"
            " SET rate_limit = :limit, rate_period_seconds = :period"
        ),
        {"q": queue, "limit": limit, "period": period},
    )


def add_jobs(conn: Connection, count: int, queue: str = "default") -> list[uuid.UUID]:
    requests = [EnqueueRequest(name="job", queue=queue) for _ in range(count)]
    return [r.id for r in enqueue_many(conn, requests)]


def claim(conn: Connection, statement: Any, *, limit: int = 100, queue: str = "default") -> int:
    params = claim_parameters(worker_id=uuid.uuid4(), lease=30.0, limit=limit, queue=queue)
    return len(conn.execute(statement, params).all())


def tokens(conn: Connection, queue: str = "default") -> float | None:
    value = conn.execute(
        text("SELECT tokens FROM pgtask.rate_buckets WHERE queue = :q"), {"q": queue}
    ).scalar()
    return None if value is None else float(value)


def test_the_governed_claim_starts_no_more_than_the_buckets_whole_tokens(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as conn:
        govern(conn, "default", limit=5, period=HOUR)
        add_jobs(conn, 20)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        # A limit set since the last claim: its bucket is created full, from the next claim on.
        assert claim(conn, statements.CLAIM_GOVERNED) == 0
        assert tokens(conn) == 5.0
        assert claim(conn, statements.CLAIM_GOVERNED, limit=3) == 3
        assert claim(conn, statements.CLAIM_GOVERNED) == 2
        assert claim(conn, statements.CLAIM_GOVERNED) == 0
        remaining = tokens(conn)
        assert remaining is not None
        assert remaining < 1


def test_the_plain_claim_never_serves_a_rate_limited_queue(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        add_jobs(conn, 5)
        govern(conn, "default", limit=1000, period=1.0)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert claim(conn, statements.CLAIM) == 0
        govern(conn, "default", limit=None, period=None)
        assert claim(conn, statements.CLAIM) == 5


def test_the_bucket_refills_with_database_time(pgtask_engine: Engine, pgtask_clock: Any) -> None:
    with pgtask_engine.begin() as conn:
        govern(conn, "default", limit=4, period=60.0)
        add_jobs(conn, 20)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        claim(conn, statements.CLAIM_GOVERNED)
        assert claim(conn, statements.CLAIM_GOVERNED) == 4
        pgtask_clock.advance(30)  # half a period: half the capacity comes back
        assert claim(conn, statements.CLAIM_GOVERNED) == 2
        pgtask_clock.advance(3600)  # never more than the capacity
        assert claim(conn, statements.CLAIM_GOVERNED) == 4


def test_concurrent_claimers_share_one_bucket(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        govern(conn, "default", limit=10, period=HOUR)
        add_jobs(conn, 100)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        claim(conn, statements.CLAIM_GOVERNED)  # creates the full bucket
    # One claimer holds the bucket in an open transaction; the other waits for it, then reads
    # what the first one left: together they never start more than the capacity.
    first = pgtask_engine.connect()
    second = pgtask_engine.connect()
    try:
        first.begin()
        taken_first = claim(first, statements.CLAIM_GOVERNED, limit=7)
        result: list[int] = []

        def other() -> None:
            with second.begin():
                result.append(claim(second, statements.CLAIM_GOVERNED, limit=7))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive(), "the second claim did not wait for the bucket"
        first.commit()
        thread.join(PATIENCE)
        assert (taken_first, result) == (7, [3])
    finally:
        first.close()
        second.close()


async def test_a_rate_limited_queue_never_starves_the_workers_other_queues(
    pgtask_async_engine: AsyncEngine,
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(govern, "limited", limit=1, period=HOUR)
        limited = await conn.run_sync(add_jobs, 10, "limited")
        free = await conn.run_sync(add_jobs, 30, "free")
    registry = Registry()
    for queue in ("limited", "free"):
        registry.task("job", queue=queue)(lambda ctx, payload: None)
    options = WorkerOptions(queues=("limited", "free"), concurrency=4, lease_duration=3.0)

    async def states(ids: list[uuid.UUID]) -> list[str]:
        async with pgtask_async_engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT state FROM pgtask.tasks WHERE id = ANY(:ids)"), {"ids": ids}
            )
            return [row.state for row in rows]

    async with running_worker(registry, pgtask_async_engine, options):

        async def free_done() -> bool:
            return set(await states(free)) == {"succeeded"}

        await wait_until(free_done, PATIENCE, message="the free queue drained")
        # One token, one start: the rest of the limited queue waits for the next hour.
        async def one_limited_done() -> bool:
            return (await states(limited)).count("succeeded") == 1

        await wait_until(one_limited_done, PATIENCE, message="one limited task ran")
    assert sorted(await states(limited)) == ["pending"] * 9 + ["succeeded"]


async def test_an_idle_worker_waits_for_the_next_token_instead_of_spinning(
    pgtask_async_engine: AsyncEngine,
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(govern, "default", limit=1, period=HOUR)
        await conn.run_sync(add_jobs, 5)
    registry = Registry()
    registry.task("job")(lambda ctx, payload: None)
    claims: list[float] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "rate_buckets" in statement and "UPDATE" in statement:
            claims.append(time.monotonic())

    event.listen(pgtask_async_engine.sync_engine, "before_cursor_execute", count)
    options = WorkerOptions(lease_duration=3.0, poll_interval=30.0)
    async with running_worker(registry, pgtask_async_engine, options):

        async def ran_one() -> bool:
            async with pgtask_async_engine.connect() as conn:
                done = await conn.execute(
                    text("SELECT count(*) FROM pgtask.tasks WHERE state = 'succeeded'")
                )
                return bool(done.scalar_one() == 1)

        await wait_until(ran_one, PATIENCE, message="the one token was spent")
        window_start = time.monotonic()
        await asyncio.sleep(1.0)  # the measurement window, not a synchronisation
        window = [t for t in claims if t >= window_start]
    # Due work, no token for an hour: the worker sleeps (a busy loop would claim hundreds).
    assert len(window) <= 3, len(window)


def test_claimers_serving_governed_queues_in_opposite_orders_never_deadlock(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as conn:
        for queue in ("qa", "qb"):
            govern(conn, queue, limit=1_000_000, period=1.0)
            add_jobs(conn, 400, queue)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def claimer(order: tuple[str, str]) -> None:
        capabilities = [
            statements.Capability(q, "job", 1, RetryPolicy.fixed(1.0), 5) for q in order
        ]
        params = statements.claim_params(
            statements.capability_params(list(order), capabilities),
            worker_id=uuid.uuid4(), lease_seconds=30.0, limit=2,
        )
        try:
            with pgtask_engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                barrier.wait(PATIENCE)
                for _ in range(300):
                    conn.execute(statements.CLAIM_GOVERNED, params).all()
        except BaseException as exc:  # reported below, with the deadlock if there was one
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(o,)) for o in (("qa", "qb"), ("qb", "qa"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    assert errors == []


def test_a_claim_never_moves_the_refill_clock_back(pgtask_engine: Engine) -> None:
    # A claim that waited for the bucket may have started before the claim that refilled it
    # last; writing its own (earlier) time would credit the tokens of that gap twice.
    with pgtask_engine.begin() as conn:
        govern(conn, "default", limit=10, period=HOUR)
        add_jobs(conn, 5)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        claim(conn, statements.CLAIM_GOVERNED, limit=1)  # creates the full bucket
        ahead = conn.execute(
            text("UPDATE pgtask.rate_buckets SET refilled_at = pgtask.now() + interval '1 hour'"
                 " RETURNING refilled_at")
        ).scalar_one()
        assert claim(conn, statements.CLAIM_GOVERNED, limit=2) == 2
        after = conn.execute(text("SELECT refilled_at FROM pgtask.rate_buckets")).scalar_one()
    assert after == ahead
