"""Metrics that must count each event once, scraped over HTTP from a real in-process worker.

Where a guarantee is "once, however long it lasts", the test lets a loop of the worker run
several rounds (counted by another metric of the same worker) before it reads the count.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, SyncTaskContext, TaskContext, WorkerOptions, cancel_async
from sqlalchemy_pgtask.testing import running_worker
from sqlalchemy_pgtask.testing import wait_until as wait_until_async
from tests.acceptance.test_metrics import free_port, scrape, value
from tests.support.tasks import add, wait_for_state
from tests.support.waiting import PATIENCE, wait_event, wait_until


async def _take_over(engine: AsyncEngine, task_id: uuid.UUID) -> None:
    """Another attempt owns the task now (as after a recovery and a claim elsewhere)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE pgtask.tasks SET lease_token = gen_random_uuid(), attempt = attempt + 1 "
                "WHERE id = :id"
            ),
            {"id": task_id},
        )


async def test_a_lost_lease_is_counted_once_while_a_stopped_sync_handler_runs_on(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    # A sync handler already told to stop (here: cancelled) that ignores it keeps its slot;
    # when its lease is then lost, every later renewal round counted the loss (and warned)
    # again, so pgtask_lease_losses_total{reason="lost"} grew for as long as the thread ran.
    tasks = Registry()
    noticed, release = threading.Event(), threading.Event()

    @tasks.task("stubborn")
    def stubborn(ctx: SyncTaskContext, payload: None) -> None:
        wait_until(lambda: ctx.cancelled, PATIENCE, message="the cancel request")
        noticed.set()
        release.wait(PATIENCE)

    steady_started = threading.Event()

    @tasks.task("steady")
    def steady(ctx: SyncTaskContext, payload: None) -> None:
        steady_started.set()
        release.wait(PATIENCE)  # renewed every round: its renewals count the rounds

    port = free_port()
    options = WorkerOptions(metrics_port=port, lease_duration=0.6, concurrency=2)
    stubborn_id = await add(pgtask_async_engine, "stubborn")
    await add(pgtask_async_engine, "steady")
    caplog.set_level(logging.INFO, logger="sqlalchemy_pgtask.worker")
    try:
        async with running_worker(tasks, pgtask_database_url, options):
            await wait_event(steady_started, PATIENCE)
            async with pgtask_async_engine.begin() as conn:
                await cancel_async(conn, stubborn_id)
            await wait_event(noticed, PATIENCE)
            await _take_over(pgtask_async_engine, stubborn_id)

            async def lost() -> bool:
                body = await asyncio.to_thread(scrape, port)
                return (value(body, "pgtask_lease_losses_total", reason="lost") or 0.0) >= 1

            await wait_until_async(lost, PATIENCE, message="the loss counted")
            body = await asyncio.to_thread(scrape, port)
            rounds = value(body, "pgtask_lease_renewals_total") or 0.0

            async def five_more_rounds() -> bool:
                body = await asyncio.to_thread(scrape, port)
                return (value(body, "pgtask_lease_renewals_total") or 0.0) >= rounds + 5

            await wait_until_async(five_more_rounds, PATIENCE, message="five renewal rounds")
            body = await asyncio.to_thread(scrape, port)
            release.set()
    finally:
        release.set()
    assert value(body, "pgtask_lease_losses_total", reason="lost") == 1.0
    warnings = [r for r in caplog.records if "lost its lease; stopping" in r.getMessage()]
    assert len(warnings) == 1


async def test_a_success_fenced_out_at_its_write_is_not_counted_as_succeeded(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    # The counters moved when the outcome was decided: a success whose write then matched no
    # lease (another attempt owned the task) was counted although nothing was stored.
    tasks = Registry()
    runs: list[int] = []

    @tasks.task("overtaken")
    async def overtaken(ctx: TaskContext, payload: None) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            await _take_over(pgtask_async_engine, ctx.task_id)  # before its outcome is written
        return "done"

    port = free_port()
    options = WorkerOptions(metrics_port=port, lease_duration=1.0, poll_interval=0.5)
    task_id = await add(pgtask_async_engine, "overtaken")
    async with running_worker(tasks, pgtask_database_url, options):
        # The taken-over lease expires, recovery takes the task back, and it runs again.
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        body = await asyncio.to_thread(scrape, port)
    assert (row["state"], len(runs)) == ("succeeded", 2)
    labels = {"queue": "default", "name": "overtaken"}
    assert value(body, "pgtask_tasks_started_total", **labels) == 2.0
    assert value(body, "pgtask_tasks_succeeded_total", **labels) == 1.0
    count = "pgtask_attempt_duration_seconds_count"
    assert value(body, count, outcome="succeeded", **labels) == 1.0
    assert value(body, count, outcome="lease_lost", **labels) == 1.0


async def test_a_success_the_database_stores_as_cancelled_is_counted_as_cancelled(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    # A cancel request made after the attempt's last renewal is known only to the database,
    # which stores the success as cancelled: it was counted as succeeded.
    tasks = Registry()

    @tasks.task("unaware")
    async def unaware(ctx: TaskContext, payload: None) -> str:
        async with pgtask_async_engine.begin() as conn:
            await cancel_async(conn, ctx.task_id)
        return "done"

    port = free_port()
    options = WorkerOptions(metrics_port=port, lease_duration=30.0)  # no renewal meanwhile
    task_id = await add(pgtask_async_engine, "unaware")
    async with running_worker(tasks, pgtask_database_url, options):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)

        async def counted() -> bool:
            body = await asyncio.to_thread(scrape, port)
            return value(body, "pgtask_attempt_duration_seconds_count", queue="default",
                         name="unaware", outcome="cancelled") == 1.0

        await wait_until_async(counted, PATIENCE, message="the cancelled attempt counted")
        body = await asyncio.to_thread(scrape, port)
    assert row["state"] == "cancelled"
    labels = {"queue": "default", "name": "unaware"}
    assert value(body, "pgtask_tasks_succeeded_total", **labels) in (None, 0.0)
