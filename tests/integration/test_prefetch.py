"""Claiming ahead of free slots (`WorkerOptions.prefetch`), with a real worker and database.

A worker whose handlers finish fast claims more tasks than it has free slots; the extra ones
wait for a slot, claimed. These tests show that it does so only while handlers finish fast,
that a waiting task which cannot start is handed back without spending an attempt, and that
a stopping worker hands back what waits. Attempts inserted by one claim share its
``started_at`` (statement time), which is how the claims' sizes are read back.
"""

from __future__ import annotations

import asyncio
import collections
import uuid

import pytest
from sqlalchemy import Engine, func, make_url, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    Registry,
    SyncTaskContext,
    TaskContext,
    WorkerOptions,
    configure_queue,
    enqueue_many,
    enqueue_many_async,
)
from sqlalchemy_pgtask.models import Attempt, Task
from sqlalchemy_pgtask.testing import drain, running_worker, wait_until
from sqlalchemy_pgtask.worker import _prefetch
from tests.support.faultproxy import fault_proxy
from tests.support.tasks import add, attempt_rows, task_row

LEASE = 2.0


async def add_many(
    engine: AsyncEngine, name: str, count: int, priority: int = 0
) -> list[uuid.UUID]:
    async with engine.begin() as conn:
        results = await enqueue_many_async(
            conn,
            [EnqueueRequest(name=name, payload=i, priority=priority) for i in range(count)],
        )
    return [r.id for r in results]


async def claim_sizes(engine: AsyncEngine) -> list[int]:
    """Attempts per claim statement, in claim order."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(func.count())
            .select_from(Attempt)
            .group_by(Attempt.started_at)
            .order_by(Attempt.started_at)
        )
        return [count for (count,) in rows]


async def states(engine: AsyncEngine) -> collections.Counter[str]:
    async with engine.connect() as conn:
        return collections.Counter((await conn.execute(select(Task.state))).scalars().all())


async def all_succeeded(engine: AsyncEngine) -> bool:
    return set(await states(engine)) == {"succeeded"}


@pytest.mark.parametrize("kind", ["async", "def"])
async def test_fast_handlers_are_claimed_ahead_of_the_free_slots_and_each_runs_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, kind: str
) -> None:
    registry = Registry()
    runs: collections.Counter[int] = collections.Counter()

    if kind == "async":

        @registry.task("fast")
        async def fast(ctx: TaskContext, payload: int) -> None:
            runs[payload] += 1

    else:

        @registry.task("fast")
        def fast_sync(ctx: SyncTaskContext, payload: int) -> None:
            runs[payload] += 1  # Counter updates hold the GIL throughout

    await add_many(pgtask_async_engine, "fast", 400)
    options = WorkerOptions(lease_duration=LEASE, concurrency=2)
    await drain(registry, pgtask_database_url, options, timeout=60)
    assert await all_succeeded(pgtask_async_engine)
    assert runs == collections.Counter(range(400))
    sizes = await claim_sizes(pgtask_async_engine)
    assert max(sizes) > 2, sizes
    assert max(sizes) <= 2 + options.prefetch


async def test_with_prefetch_0_a_claim_never_takes_more_than_the_free_slots(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("fast")
    async def fast(ctx: TaskContext, payload: int) -> None:
        return None

    await add_many(pgtask_async_engine, "fast", 200)
    options = WorkerOptions(lease_duration=LEASE, concurrency=2, prefetch=0)
    await drain(registry, pgtask_database_url, options, timeout=60)
    assert await all_succeeded(pgtask_async_engine)
    assert max(await claim_sizes(pgtask_async_engine)) <= 2


async def test_handlers_slower_than_the_horizon_are_claimed_only_for_free_slots(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("slow")
    async def slow(ctx: TaskContext, payload: int) -> None:
        await asyncio.sleep(0.15)  # the workload: two slots finish ~13 handlers a second

    await add_many(pgtask_async_engine, "slow", 12)
    options = WorkerOptions(lease_duration=LEASE, concurrency=2)
    await drain(registry, pgtask_database_url, options, timeout=60)
    assert await all_succeeded(pgtask_async_engine)
    assert max(await claim_sizes(pgtask_async_engine)) <= 2


async def test_a_rate_limited_queue_is_claimed_only_for_free_slots(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    """Tokens are spent by the claim: claimed ahead, they would be spent before the starts
    they count (or for nothing, if handed back)."""
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "default", rate_limit=1_000_000, rate_period=1.0)
    registry = Registry()

    @registry.task("fast")
    async def fast(ctx: TaskContext, payload: int) -> None:
        return None

    await add_many(pgtask_async_engine, "fast", 200)
    options = WorkerOptions(lease_duration=LEASE, concurrency=2)
    await drain(registry, pgtask_database_url, options, timeout=60)
    assert await all_succeeded(pgtask_async_engine)
    assert max(await claim_sizes(pgtask_async_engine)) <= 2


@pytest.fixture
def long_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claim ahead for up to 0.5 s after a handler finished, so a slow test machine's pauses
    between a finish and the next claim cannot keep a test's tasks from being claimed ahead."""
    monkeypatch.setattr(_prefetch, "HORIZON", 0.5)
    monkeypatch.setattr(_prefetch, "_BUCKETS", 2)  # the window stays a second


async def blocked_behind_fast_tasks(
    engine: AsyncEngine, registry: Registry, release: asyncio.Event
) -> tuple[uuid.UUID, list[uuid.UUID], collections.Counter[uuid.UUID]]:
    """Fast tasks first (highest priority), then one that blocks until ``release``, then the
    tail: with one slot, the tail is claimed ahead while the blocker holds the slot."""
    runs: collections.Counter[uuid.UUID] = collections.Counter()

    @registry.task("fast")
    async def fast(ctx: TaskContext, payload: int) -> None:
        runs[ctx.task_id] += 1

    @registry.task("blocker")
    async def blocker(ctx: TaskContext, payload: None) -> None:
        runs[ctx.task_id] += 1
        await release.wait()

    await add_many(engine, "fast", 300, priority=10)
    blocker_id = await add(engine, "blocker", priority=5)
    tail = await add_many(engine, "fast", 3, priority=0)
    return blocker_id, tail, runs


async def tail_handed_back(engine: AsyncEngine, tail: list[uuid.UUID]) -> bool:
    for task_id in tail:
        if "released" not in [a["state"] for a in await attempt_rows(engine, task_id)]:
            return False
    return True


async def assert_tail_ran_once_after_its_hand_back(
    engine: AsyncEngine, tail: list[uuid.UUID], runs: collections.Counter[uuid.UUID]
) -> None:
    for task_id in tail:
        assert runs[task_id] == 1
        row = await task_row(engine, task_id)
        assert (row["state"], row["failed_attempts"]) == ("succeeded", 0)
        attempts = [a["state"] for a in await attempt_rows(engine, task_id)]
        assert attempts[-1] == "succeeded"
        assert set(attempts[:-1]) == {"released"}


async def test_a_task_claimed_ahead_that_waits_too_long_is_handed_back_unspent(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, long_horizon: None
) -> None:
    registry = Registry()
    release = asyncio.Event()
    blocker_id, tail, runs = await blocked_behind_fast_tasks(
        pgtask_async_engine, registry, release
    )
    options = WorkerOptions(lease_duration=LEASE, concurrency=1)
    async with running_worker(registry, pgtask_database_url, options):
        # The blocker holds the only slot; the tail, claimed ahead, never starts.
        await wait_until(lambda: runs[blocker_id] == 1, 60, message="the blocker started")
        await wait_until(lambda: tail_handed_back(pgtask_async_engine, tail), 60,
                         message="the tail was handed back")
        assert all(runs[task_id] == 0 for task_id in tail)
        assert (await task_row(pgtask_async_engine, blocker_id))["state"] == "running"
        release.set()
        await wait_until(lambda: all_succeeded(pgtask_async_engine), 60,
                         message="every task succeeded")
    assert set(runs.values()) == {1}
    await assert_tail_ran_once_after_its_hand_back(pgtask_async_engine, tail, runs)


async def test_a_hand_back_whose_answer_is_lost_never_starts_the_task_twice(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, long_horizon: None
) -> None:
    """The hand-back commits, its answer never arrives: the task is pending and may be
    claimed again, so the row it was claimed as must never start."""
    registry = Registry()
    release = asyncio.Event()
    blocker_id, tail, runs = await blocked_behind_fast_tasks(
        pgtask_async_engine, registry, release
    )
    url = make_url(pgtask_database_url)
    async with fault_proxy(str(url.host or "127.0.0.1"), int(url.port or 5432)) as proxy:
        proxy.drop_after_commit(b"THEN 'released'")
        proxied = url.set(host="127.0.0.1", port=proxy.port).update_query_dict(
            {"sslmode": "disable"}
        ).render_as_string(hide_password=False)
        options = WorkerOptions(lease_duration=LEASE, concurrency=1)
        async with running_worker(registry, proxied, options):
            await wait_until(lambda: runs[blocker_id] == 1, 60, message="the blocker started")
            await proxy.wait_dropped()
            await wait_until(lambda: tail_handed_back(pgtask_async_engine, tail), 60,
                             message="the tail was handed back")
            release.set()
            await wait_until(lambda: all_succeeded(pgtask_async_engine), 60,
                             message="every task succeeded")
    assert set(runs.values()) == {1}
    await assert_tail_ran_once_after_its_hand_back(pgtask_async_engine, tail, runs)


@pytest.mark.parametrize("immediate", [False, True])
async def test_a_stopping_worker_hands_back_the_tasks_waiting_for_a_slot(
    pgtask_database_url: str,
    pgtask_async_engine: AsyncEngine,
    long_horizon: None,
    monkeypatch: pytest.MonkeyPatch,
    immediate: bool,
) -> None:
    # Stale only after a quarter of the 30 s lease: the stop is what hands them back.
    monkeypatch.setattr(_prefetch, "MAX_WAIT", 600.0)
    registry = Registry()
    release = asyncio.Event()
    blocker_id, tail, runs = await blocked_behind_fast_tasks(
        pgtask_async_engine, registry, release
    )
    options = WorkerOptions(lease_duration=30.0, concurrency=1, shutdown_grace=30.0)

    async def tail_in(state: str) -> bool:
        return [(await task_row(pgtask_async_engine, t))["state"] for t in tail] == [state] * 3

    async with running_worker(registry, pgtask_database_url, options) as worker:
        await wait_until(lambda: runs[blocker_id] == 1, 60, message="the blocker started")
        await wait_until(lambda: tail_in("running"), 60, message="the tail was claimed ahead")
        assert all(runs[task_id] == 0 for task_id in tail)
        worker.shutdown(immediate=immediate)
        # Handed back at once: while the blocker still runs in the grace period, or with it.
        await wait_until(lambda: tail_in("pending"), 30, message="the tail was handed back")
        if not immediate:
            assert (await task_row(pgtask_async_engine, blocker_id))["state"] == "running"
            release.set()

            async def blocker_succeeded() -> bool:
                row = await task_row(pgtask_async_engine, blocker_id)
                return bool(row["state"] == "succeeded")

            await wait_until(blocker_succeeded, 30, message="the blocker finished in the grace")
    for task_id in tail:
        assert runs[task_id] == 0
        row = await task_row(pgtask_async_engine, task_id)
        assert (row["state"], row["failed_attempts"]) == ("pending", 0)
        assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
            "released"
        ]


async def test_tasks_claimed_together_start_earlier_queues_first(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    queues = ("high", "mid", "low")
    started: list[str] = []
    for queue in queues:

        @registry.task("step", queue=queue)
        async def step(ctx: TaskContext, payload: int) -> None:
            started.append(ctx.queue)

    for queue in reversed(queues):  # the oldest tasks are in the last queue
        async with pgtask_async_engine.begin() as conn:
            await enqueue_many_async(
                conn, [EnqueueRequest(name="step", queue=queue, payload=i) for i in range(80)]
            )
    options = WorkerOptions(queues=queues, concurrency=1, lease_duration=LEASE)
    async with running_worker(registry, pgtask_database_url, options):
        await wait_until(lambda: len(started) == 240, 60, message="every task ran")
    assert max(await claim_sizes(pgtask_async_engine)) > 1  # claims spanned queues
    assert started == [q for q in queues for _ in range(80)]


async def test_a_queue_that_becomes_governed_is_never_claimed_ahead(
    pgtask_database_url: str,
    pgtask_async_engine: AsyncEngine,
    pgtask_engine: Engine,
    long_horizon: None,
) -> None:
    """The claim loop learns that a queue is governed (here by a starvation timeout, which
    has no token bucket to hold the first claim back) on a later pass, every
    GOVERNED_REFRESH: the claim made on that pass must already keep to the free slots,
    while the worker's other queue keeps handlers finishing fast."""
    registry = Registry()
    for queue in ("limited", "busy"):

        @registry.task("step", queue=queue)
        async def step(ctx: TaskContext, payload: int) -> None:
            await asyncio.sleep(0.001)

    async with pgtask_async_engine.begin() as conn:
        await enqueue_many_async(
            conn, [EnqueueRequest(name="step", queue="busy", payload=i) for i in range(6_000)]
        )
    options = WorkerOptions(queues=("limited", "busy"), concurrency=2, lease_duration=LEASE)
    async with running_worker(registry, pgtask_database_url, options):
        async def going() -> bool:
            return (await states(pgtask_async_engine))["succeeded"] >= 200

        await wait_until(going, 60, message="the worker got going")
        with pgtask_engine.begin() as sync:  # due the moment the queue is governed
            configure_queue(sync, "limited", starvation_timeout=600)
            enqueue_many(
                sync, [EnqueueRequest(name="step", queue="limited", payload=i) for i in range(300)]
            )

        async def limited_done() -> bool:
            async with pgtask_async_engine.connect() as conn:
                return (await conn.execute(
                    select(func.count()).where(Task.queue == "limited", Task.state != "succeeded")
                )).scalar_one() == 0

        # The rest of "busy" is not waited for: once governed, the worker claims two at a time
        # for every queue, which would take this test half a minute more.
        await wait_until(limited_done, 120, message="every task of the governed queue succeeded")
    async with pgtask_async_engine.connect() as conn:
        sizes = (await conn.execute(
            select(func.count())
            .select_from(Attempt)
            .join(Task, Task.id == Attempt.task_id)
            .group_by(Attempt.started_at)
            .having(func.bool_or(Task.queue == "limited"))
        )).scalars().all()
    assert sizes
    assert max(sizes) <= 2, sorted(sizes)[-5:]
