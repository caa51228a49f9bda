"""The outcome writer under faults: one outcome that cannot be written now (its waiting parent
held by another transaction, a statement cut short) never holds back the others, and one that
keeps failing is given up after a bounded number of tries: its lease lapses and recovery
retries the task.

Each test makes the fault for real: a row lock held by another connection, a statement that
runs past the worker's ``statement_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.acceptance.test_metrics import free_port, scrape, value
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE

FAST = WorkerOptions(lease_duration=3.0, poll_interval=30.0, shutdown_grace=2.0)


def _family(registry: Registry, child_go: asyncio.Event) -> list[TaskContext]:
    """Register a parent that spawns a child and returns its result, and the child, which
    records each run's context and returns its attempt number once ``child_go`` is set."""
    runs: list[TaskContext] = []

    @registry.task("parent")
    async def parent(ctx: TaskContext, payload: None) -> str:
        kid = await ctx.spawn("spawn", "child")
        done = await ctx.wait_for_result("wait", kid)
        return str(done.result)

    @registry.task("child")
    async def child(ctx: TaskContext, payload: None) -> int:
        runs.append(ctx)
        await child_go.wait()
        return ctx.attempt

    return runs


async def _hold(holder: AsyncConnection, task_id: uuid.UUID) -> None:
    """Lock the task's row in ``holder``'s transaction, as a business transaction would."""
    await holder.execute(
        text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR NO KEY UPDATE"), {"id": task_id}
    )


async def test_an_outcome_whose_waiting_parent_is_locked_does_not_hold_back_other_outcomes(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    child_go = asyncio.Event()
    runs = _family(registry, child_go)

    @registry.task("other")
    async def other(ctx: TaskContext, payload: None) -> str:
        return "other done"

    parent_id = await add(pgtask_async_engine, "parent")
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        await wait_until(lambda: len(runs) == 1, message="the child to start")
        child_id = runs[0].task_id
        await wait_for_state(pgtask_async_engine, parent_id, ("waiting",))
        async with pgtask_async_engine.connect() as holder:
            # A business transaction holds the waiting parent's row: the child's completion
            # cannot wake it now (55P03) and must be written later.
            await _hold(holder, parent_id)
            child_go.set()
            # The child's outcome reaches the writer before the other task is even enqueued.
            await wait_until(lambda: worker.running_count == 0, message="the child to end")
            other_id = await add(pgtask_async_engine, "other")
            # While the parent stays locked, the unrelated outcome is written all the same.
            other_row = await wait_for_state(pgtask_async_engine, other_id, timeout=10)
            assert (await task_row(pgtask_async_engine, child_id))["state"] == "running"
            await holder.rollback()
        child_row = await wait_for_state(pgtask_async_engine, child_id, timeout=30)
        parent_row = await wait_for_state(pgtask_async_engine, parent_id, timeout=30)

    assert (other_row["state"], other_row["result"]) == ("succeeded", "other done")
    assert (child_row["state"], child_row["attempt"]) == ("succeeded", 1)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, child_id)] == [
        "succeeded"
    ]
    assert parent_row["state"] == "succeeded"


_SLOW = """
CREATE FUNCTION slow_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Stands in for an outcome whose triggers run long (a large subtree to cancel).
    PERFORM pg_sleep(5);
    RETURN NEW;
END $$
---
CREATE TRIGGER slow_outcome BEFORE UPDATE OF state ON pgtask.tasks
    FOR EACH ROW WHEN (NEW.id = '{slow}' AND NEW.state = 'succeeded' AND NEW.attempt = 1)
    EXECUTE FUNCTION slow_outcome()
"""


def _given_up(caplog: pytest.LogCaptureFixture, task_id: uuid.UUID) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if "was given up" in r.getMessage() and str(task_id) in r.getMessage()
    ]


async def test_an_outcome_always_past_statement_timeout_is_given_up_and_its_task_recovered(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its first attempt's success always runs past statement_timeout. It used to be tried
    # again every 2 s for ever, each try holding the writer (and every outcome behind it)
    # for the whole timeout. Now: the other outcome is written, the slow one is given up at
    # its second try alone, its lease lapses, and recovery runs the task again.
    registry = Registry()
    release = asyncio.Event()
    started: list[uuid.UUID] = []

    @registry.task("pair")
    async def pair(ctx: TaskContext, payload: None) -> int:
        started.append(ctx.task_id)
        await release.wait()  # both finish in the same moment: one batch
        return ctx.attempt

    slow = await add(pgtask_async_engine, "pair")
    quick = await add(pgtask_async_engine, "pair")
    async with pgtask_async_engine.begin() as conn:
        for statement in _SLOW.format(slow=slow).split("---"):
            await conn.exec_driver_sql(statement)
    port = free_port()
    options = WorkerOptions(
        lease_duration=3.0, poll_interval=30.0, shutdown_grace=2.0, statement_timeout=0.5,
        metrics_port=port,
    )
    caplog.set_level(logging.INFO, logger="sqlalchemy_pgtask.worker")
    async with running_worker(registry, pgtask_database_url, options):
        await wait_until(lambda: len(started) == 2, message="both handlers to start")
        release.set()
        quick_row = await wait_for_state(pgtask_async_engine, quick, timeout=PATIENCE)
        await wait_until(lambda: bool(_given_up(caplog, slow)), PATIENCE,
                         message="the slow outcome given up")
        slow_row = await wait_for_state(pgtask_async_engine, slow, timeout=PATIENCE)
        body = await asyncio.to_thread(scrape, port)

    assert (quick_row["state"], quick_row["attempt"]) == ("succeeded", 1)
    assert (slow_row["state"], slow_row["result"], slow_row["failed_attempts"]) == (
        "succeeded", 2, 1,
    )
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, slow)] == [
        "lost", "succeeded",
    ]
    (message,) = _given_up(caplog, slow)
    assert "after 2 tries" in message
    assert "statement_timeout" in message or "QueryCanceled" in message
    labels = {"queue": "default", "name": "pair"}
    assert value(body, "pgtask_outcomes_given_up_total", reason="statement_timeout",
                 **labels) == 1.0
    assert value(body, "pgtask_tasks_succeeded_total", **labels) == 2.0
    assert value(body, "pgtask_outcomes_set_aside") == 0.0


async def test_an_outcome_whose_waiting_parent_stays_locked_is_given_up_within_a_lease(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A business transaction holds the waiting parent's row for as long as it likes: the
    # child's success cannot wake it (55P03 at every try). It was set aside for ever, its
    # lease renewed; now it is given up after ten tries (within about a lease), its lease
    # lapses, and the child runs again once the parent is free.
    registry = Registry()
    child_go = asyncio.Event()
    runs = _family(registry, child_go)
    parent_id = await add(pgtask_async_engine, "parent")
    caplog.set_level(logging.INFO, logger="sqlalchemy_pgtask.worker")
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        await wait_until(lambda: len(runs) == 1, PATIENCE, message="the child to run")
        await wait_for_state(pgtask_async_engine, parent_id, ("waiting",))
        child_id = runs[0].task_id
        async with pgtask_async_engine.connect() as holder:
            await _hold(holder, parent_id)
            child_go.set()
            await wait_until(lambda: bool(_given_up(caplog, child_id)), PATIENCE,
                             message="the child's outcome given up")
            await wait_until(lambda: worker.active_count == 0, PATIENCE,
                             message="its lease no longer renewed")
            assert (await task_row(pgtask_async_engine, child_id))["state"] == "running"
            await holder.rollback()
        parent_row = await wait_for_state(pgtask_async_engine, parent_id, timeout=PATIENCE)

    (message,) = _given_up(caplog, child_id)
    assert "after 10 tries" in message
    assert [ctx.attempt for ctx in runs] == [1, 2]
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, child_id)] == [
        "lost", "succeeded",
    ]
    assert (parent_row["state"], parent_row["result"]) == ("succeeded", "2")
