"""Concurrency keys (issue 26) from every place a task comes from, and a definition's policy:
a worker never runs more than the definition's limit of one key at once, the limit and scope
are frozen with the retry policy, and schedules and spawned children carry a key."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    HandlerPolicy,
    InvalidOptionError,
    PolicyConflict,
    Registry,
    Task,
    TaskContext,
    TaskDefinition,
    WorkerOptions,
    enqueue,
    enqueue_many_async,
)
from sqlalchemy_pgtask.schedule import materialize_schedules, set_schedule
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.durable import claim_one, spawn
from tests.support.tasks import add, task_row
from tests.support.waiting import PATIENCE

UTC = timezone.utc
FAST = WorkerOptions(concurrency=6, prefetch=0, poll_interval=0.05)


async def test_a_worker_runs_no_more_than_the_definitions_limit_of_one_key(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    running: dict[str, int] = {}
    most: dict[str, int] = {}

    @registry.task("export", concurrency_limit=2)
    async def export(ctx: TaskContext, payload: dict[str, Any]) -> None:
        key = payload["key"]
        running[key] = running.get(key, 0) + 1
        most[key] = max(most.get(key, 0), running[key])
        await asyncio.sleep(0.02)  # the handler's own work, not synchronisation
        running[key] -= 1

    async with pgtask_async_engine.begin() as conn:
        results = await enqueue_many_async(conn, [
            export.request({"key": key}, concurrency_key=key)
            for key in ("a", "b") for _ in range(6)
        ])
    async with running_worker(registry, pgtask_database_url, FAST):
        async def done() -> bool:
            rows = [await task_row(pgtask_async_engine, r.id) for r in results]
            return all(row["state"] == "succeeded" for row in rows)

        await wait_until(done, PATIENCE, message="every task to succeed")
    assert set(most) == {"a", "b"}
    assert max(most.values()) <= 2
    async with pgtask_async_engine.connect() as conn:
        policy = (await conn.execute(select(HandlerPolicy.__table__))).mappings().one()
    assert (policy["concurrency_limit"], policy["concurrency_scope"]) == (2, "workflow")


async def test_registering_another_concurrency_policy_for_a_known_handler_is_a_conflict(
    pgtask_database_url: str,
) -> None:
    first = Registry()
    first.task("export", concurrency_limit=2)(lambda ctx, payload: None)
    async with running_worker(first, pgtask_database_url, FAST):
        pass
    for changed in ({"concurrency_limit": 3}, {"concurrency_limit": 2,
                                                "concurrency_scope": "running"}):
        second = Registry()
        second.task("export", **changed)(lambda ctx, payload: None)
        with pytest.raises(PolicyConflict, match="new version"):
            async with running_worker(second, pgtask_database_url, FAST):
                pytest.fail("a worker with a conflicting policy must not start")


async def test_a_definitions_enqueue_carries_the_key_and_limit(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    definition: TaskDefinition[Any, Any] = registry.task("export")(lambda ctx, payload: None)
    async with pgtask_async_engine.begin() as conn:
        task_id = (await definition.enqueue_async(
            conn, None, concurrency_key="tenant-1", concurrency_limit=4
        )).id
    row = await task_row(pgtask_async_engine, task_id)
    assert (row["concurrency_key"], row["concurrency_limit"]) == ("tenant-1", 4)
    plain = await add(pgtask_async_engine, "export")
    assert (await task_row(pgtask_async_engine, plain))["concurrency_key"] is None


def test_a_spawned_child_carries_its_key(pgtask_engine: Engine) -> None:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        enqueue(conn, "job")
        lease = claim_one(conn)
        row = spawn(conn, lease, "child", concurrency_key="file-9", concurrency_limit=2)
        child = conn.execute(
            select(Task.concurrency_key, Task.concurrency_limit).where(Task.id == row.child_id)
        ).one()
    assert tuple(child) == ("file-9", 2)


def test_every_occurrence_of_a_schedule_carries_its_key(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    at = datetime(2030, 6, 3, 10, 0, 30, tzinfo=UTC)
    pgtask_clock.set_offset((at - datetime.now(UTC)).total_seconds())
    with Session(pgtask_engine) as session:
        info = set_schedule(
            session, "nightly", task="job", cron="* * * * *", concurrency_key="report",
            concurrency_limit=1,
        )
        session.commit()
    assert (info.concurrency_key, info.concurrency_limit) == ("report", 1)
    pgtask_clock.advance(90)
    assert materialize_schedules(pgtask_engine).created == 1
    with Session(pgtask_engine) as session:
        task = session.execute(select(Task)).scalar_one()
    assert (task.concurrency_key, task.concurrency_limit) == ("report", 1)


def test_a_schedules_bad_key_or_limit_is_refused_before_any_sql(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(InvalidOptionError, match="concurrency_limit"):
            set_schedule(session, "s", task="job", cron="* * * * *", concurrency_limit=2)
        registry = Registry()
        definition: TaskDefinition[Any, Any] = registry.task("job")(lambda ctx, payload: None)
        with pytest.raises(InvalidOptionError, match="concurrency_limit"):
            registry.schedule("s", cron="* * * * *", concurrency_key="k",
                              concurrency_limit=0)(definition)
