"""``ctx.scheduled_for`` and ``ctx.schedule_name``: a scheduled task knows its occurrence.

The materialiser writes the occurrence into the reserved header ``pgtask.schedule``; the
worker takes it out of the headers the handler sees and puts it on the context, a
timezone-aware UTC instant equal to the task's ``scheduled_for``. A task not made by a
schedule sees None for both. Callers cannot forge the header: enqueue, spawn and schedules
refuse it before any SQL. Database time is moved with the clock fixture; nothing sleeps.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, literal_column, select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    PayloadError,
    Registry,
    RetryPolicy,
    SyncTaskContext,
    Task,
    TaskContext,
    WorkerOptions,
    enqueue,
    enqueue_many,
)
from sqlalchemy_pgtask._defaults import SCHEDULE_HEADER
from sqlalchemy_pgtask.schedule import materialize_schedules, set_schedule
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from sqlalchemy_pgtask.validation import HEADERS_MAX_BYTES
from tests.support.tasks import TERMINAL, add, task_row
from tests.support.waiting import PATIENCE

UTC = timezone.utc
#: 30 s into a minute of database time, so the seconds a test takes never cross an occurrence.
T0 = datetime(2030, 6, 3, 10, 0, 30, tzinfo=UTC)
OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.2)

#: What each handler saw, by task id: (schedule_name, scheduled_for, headers).
Seen = dict[uuid.UUID, tuple[str | None, datetime | None, dict[str, Any]]]


@pytest.fixture
def at_t0(pgtask_clock: DatabaseClock) -> DatabaseClock:
    pgtask_clock.set_offset((T0 - datetime.now(UTC)).total_seconds())
    return pgtask_clock


def recording(seen: Seen, *, is_async: bool) -> Registry:
    registry = Registry()
    if is_async:
        @registry.task("report", retry=RetryPolicy.never())
        async def report(ctx: TaskContext, payload: None) -> None:
            seen[ctx.task_id] = (ctx.schedule_name, ctx.scheduled_for, dict(ctx.headers))
    else:
        @registry.task("report", retry=RetryPolicy.never())
        def report_sync(ctx: SyncTaskContext, payload: None) -> None:
            seen[ctx.task_id] = (ctx.schedule_name, ctx.scheduled_for, dict(ctx.headers))
    return registry


def schedule(engine: Engine, name: str, **options: Any) -> None:
    options.setdefault("cron", "* * * * *")
    with Session(engine) as session:
        set_schedule(session, name, task="report", **options)
        session.commit()


def occurrence_tasks(engine: Engine, name: str) -> dict[uuid.UUID, datetime]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(Task.id, Task.scheduled_for).where(Task.schedule_name == name)
        ).all()
    return {row.id: row.scheduled_for.astimezone(UTC) for row in rows}


async def run_all(
    registry: Registry, url: str, engine: AsyncEngine, seen: Seen, task_ids: list[uuid.UUID]
) -> None:
    async with running_worker(registry, url, OPTIONS):
        await wait_until(
            lambda: set(task_ids) <= set(seen), PATIENCE, message="every task ran"
        )
    for task_id in task_ids:
        row = await task_row(engine, task_id)
        assert row["state"] in TERMINAL
        assert row["state"] == "succeeded", row["error"]


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
async def test_a_scheduled_tasks_handler_sees_its_occurrence_and_a_plain_one_none(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str,
    at_t0: DatabaseClock, is_async: bool,
) -> None:
    # 12:01 in Paris (summer time, UTC+2) is 10:01 UTC: the instant comes back in UTC.
    schedule(pgtask_engine, "lunch", cron="1 12 * * *", timezone="Europe/Paris",
             headers={"tenant": "acme"})
    at_t0.advance(60)
    assert materialize_schedules(pgtask_engine).created == 1
    [(scheduled_id, occurrence)] = occurrence_tasks(pgtask_engine, "lunch").items()
    assert occurrence == datetime(2030, 6, 3, 10, 1, tzinfo=UTC)
    plain_id = await add(pgtask_async_engine, "report", headers={"tenant": "acme"})
    seen: Seen = {}
    registry = recording(seen, is_async=is_async)
    await run_all(registry, pgtask_database_url, pgtask_async_engine, seen,
                  [scheduled_id, plain_id])
    name, scheduled_for, headers = seen[scheduled_id]
    assert (name, scheduled_for) == ("lunch", occurrence)
    assert scheduled_for is not None
    assert scheduled_for.utcoffset() == timedelta(0)
    assert headers == {"tenant": "acme"}  # the reserved header is the context's, not theirs
    assert seen[plain_id] == (None, None, {"tenant": "acme"})


async def test_each_caught_up_occurrence_sees_its_own_instant(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str,
    at_t0: DatabaseClock,
) -> None:
    schedule(pgtask_engine, "catching-up", misfire="catch_up", catch_up_limit=3)
    schedule(pgtask_engine, "latest-only")  # misfire="latest", the default
    at_t0.advance(10 * 60)  # 10:10:30: 10:10 on time, nine occurrences missed
    materialize_schedules(pgtask_engine)
    caught_up = occurrence_tasks(pgtask_engine, "catching-up")
    latest = occurrence_tasks(pgtask_engine, "latest-only")
    assert sorted(caught_up.values()) == [
        datetime(2030, 6, 3, 10, m, tzinfo=UTC) for m in (7, 8, 9, 10)
    ]
    assert list(latest.values()) == [datetime(2030, 6, 3, 10, 10, tzinfo=UTC)]
    seen: Seen = {}
    await run_all(recording(seen, is_async=True), pgtask_database_url, pgtask_async_engine,
                  seen, [*caught_up, *latest])
    for task_id, occurrence in caught_up.items():
        assert seen[task_id][:2] == ("catching-up", occurrence)
    for task_id, occurrence in latest.items():
        assert seen[task_id][:2] == ("latest-only", occurrence)


def count_tasks(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(Task)).scalar_one()


def test_callers_cannot_forge_the_reserved_header(pgtask_engine: Engine) -> None:
    forged = {SCHEDULE_HEADER: {"name": "nightly", "scheduled_for": T0.isoformat()}}
    with Session(pgtask_engine) as session:
        with pytest.raises(PayloadError) as refused:
            enqueue(session, "report", headers=forged)
        assert refused.value.field == "headers"
        with pytest.raises(PayloadError) as refused:
            enqueue_many(session, [EnqueueRequest(name="report"),
                                   EnqueueRequest(name="report", headers=forged)])
        assert refused.value.field == "[1].headers"
        with pytest.raises(PayloadError) as refused:
            set_schedule(session, "forger", task="report", cron="* * * * *", headers=forged)
        assert refused.value.field == "headers"
        session.commit()
    assert count_tasks(pgtask_engine) == 0


def test_a_schedules_headers_leave_room_for_the_occurrence(pgtask_engine: Engine) -> None:
    # Headers that would fit a task but not with the occurrence added: refused up front,
    # not by the database at every occurrence.
    big = {"blob": "x" * (HEADERS_MAX_BYTES - 300)}
    with Session(pgtask_engine) as session:
        with pytest.raises(PayloadError) as refused:
            set_schedule(session, "bulky", task="report", cron="* * * * *", headers=big)
        assert refused.value.field == "headers"
        enqueue(session, "report", headers=big)  # a plain task may use all of them
        session.commit()


async def test_a_spawned_child_cannot_forge_it_either(
    pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    refused: list[str] = []
    registry = Registry()

    @registry.task("parent", retry=RetryPolicy.never())
    async def parent(ctx: TaskContext, payload: None) -> None:
        try:
            await ctx.spawn("child", "report", headers={SCHEDULE_HEADER: {}})
        except PayloadError as exc:
            refused.append(exc.field)

    task_id = await add(pgtask_async_engine, "parent")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_until(lambda: bool(refused), PATIENCE, message="the spawn was refused")
    assert refused == ["headers"]
    async with pgtask_async_engine.connect() as conn:
        children = (await conn.execute(
            select(func.count()).where(Task.parent_id == task_id)
        )).scalar_one()
    assert children == 0


async def test_a_header_written_by_hand_that_does_not_parse_gives_none(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    # Only raw SQL can write it; a malformed one must not stop the task.
    task_ids = [uuid.uuid4() for _ in range(3)]
    values: list[Any] = [
        "nightly", {"name": "n", "scheduled_for": "not a time"},
        {"name": "n", "scheduled_for": "2030-06-03T10:01:00"},  # naive: no instant
    ]
    with pgtask_engine.begin() as connection:
        for task_id, value in zip(task_ids, values, strict=True):
            connection.execute(insert(Task).values(
                id=task_id, queue="default", name="report", headers={SCHEDULE_HEADER: value},
                payload=literal_column("'null'::jsonb"),
            ))
    seen: Seen = {}
    await run_all(recording(seen, is_async=True), pgtask_database_url, pgtask_async_engine,
                  seen, task_ids)
    assert [seen[task_id] for task_id in task_ids] == [(None, None, {})] * 3
