"""A handler stopped before its coroutine took its first step, with a real worker and database.

The claim loop starts a handler by creating its task; the watchdog may stop it in the same
turn of the event loop, before that task ever runs (a claim whose answer arrived after the
loop was blocked for most of a lease: the rows' leases were sent long ago). A task cancelled
before its first step never runs its coroutine's ``try``/``finally``: the attempt must still
be settled and its task handed back, or its slot is lost and its lease renewed for ever.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, read_task
from tests.support.waiting import PATIENCE

LEASE = 1.0


async def test_a_handler_stopped_before_its_first_step_is_handed_back_and_runs_again(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    registry = Registry()
    claim_waiting = asyncio.Event()
    blocking = threading.Event()
    runs: list[int] = []

    @registry.task("blocker")
    async def blocker(ctx: TaskContext, payload: None) -> None:
        if ctx.attempt > 1:
            return
        await claim_waiting.wait()
        # Blocks the event loop while the claim of "late" is in flight: its answer is read
        # after the loop wakes, when its lease was sent longer ago than the watchdog allows.
        blocking.set()
        time.sleep(LEASE * 1.2)  # noqa: ASYNC251 - the blocked loop is the fault under test

    @registry.task("late")
    async def late(ctx: TaskContext, payload: None) -> None:
        runs.append(ctx.attempt)

    def hold_attempts(locked: threading.Event) -> None:
        # The claim's attempt row waits for this lock (well within its lock timeout), which
        # goes once the loop is blocked: the claim's answer then waits in the socket.
        with pgtask_engine.connect() as holder:
            holder.execute(text("LOCK TABLE pgtask.attempts IN SHARE MODE"))
            locked.set()
            blocking.wait(PATIENCE)
            holder.rollback()

    def state(task_id: uuid.UUID) -> str:
        with pgtask_engine.connect() as probe:
            return str(read_task(probe, task_id)["state"])

    def claim_blocked() -> bool:
        with pgtask_engine.connect() as probe:
            return bool(probe.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE 'WITH capabilities AS%'"  # the claim (its text is cut at 1 kB)
            )).scalar_one())

    options = WorkerOptions(concurrency=2, lease_duration=LEASE, prefetch=0)
    async with running_worker(registry, pgtask_database_url, options) as worker:
        blocked = await add(pgtask_async_engine, "blocker")
        await wait_until(lambda: state(blocked) == "running", PATIENCE)
        locked = threading.Event()
        holder = threading.Thread(target=hold_attempts, args=(locked,), daemon=True)
        holder.start()
        await asyncio.to_thread(locked.wait, PATIENCE)
        late_id = await add(pgtask_async_engine, "late")
        await wait_until(claim_blocked, PATIENCE)
        claim_waiting.set()
        await wait_until(
            lambda: state(late_id) == "succeeded", PATIENCE,
            message="the late task to be handed back and run",
        )
        await wait_until(lambda: worker.running_count == 0, PATIENCE)
        holder.join(PATIENCE)
    assert runs
