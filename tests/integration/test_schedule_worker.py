"""Schedules in the worker: the maintenance service on the worker's kind of connection (an
autocommit `HeldConnection`), under the maintenance runner; schedules declared in code and
reconciled at start; the async API."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from sqlalchemy_pgtask import InvalidOptionError, Registry, Task, WorkerOptions
from sqlalchemy_pgtask.models import AuditEntry, Schedule
from sqlalchemy_pgtask.schedule import (
    delete_schedule_async,
    get_schedule_async,
    list_schedules_async,
    materialize_schedules_async,
    pause_schedule_async,
    resume_schedule_async,
    set_schedule_async,
)
from sqlalchemy_pgtask.schedule.misfire import plan_occurrences
from sqlalchemy_pgtask.schedule.spec import schedule_spec
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from sqlalchemy_pgtask.worker._maintenance import MaintenanceRunner
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._schedule import Schedules, reconcile_schedules
from tests.support.waiting import PATIENCE, SLOW_POLL

_T = TypeVar("_T")
UTC = timezone.utc
T0 = datetime(2030, 6, 3, 10, 0, 30, tzinfo=UTC)


def set_now(clock: DatabaseClock, at: datetime) -> None:
    clock.set_offset((at - datetime.now(UTC)).total_seconds())


def held(engine: AsyncEngine) -> HeldConnection:
    return HeldConnection(
        engine.execution_options(isolation_level="AUTOCOMMIT"),
        lock_timeout=5.0, statement_timeout=30.0,
    )


async def scheduled(engine: AsyncEngine, name: str) -> list[datetime]:
    async with engine.connect() as connection:
        rows = await connection.execute(
            select(Task.scheduled_for).where(Task.schedule_name == name)
            .order_by(Task.scheduled_for)
        )
        return [r.astimezone(UTC) for r in rows.scalars() if r is not None]


async def test_the_service_materialises_and_sleeps_until_the_next_occurrence(
    pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    set_now(pgtask_clock, T0)
    async with AsyncSession(pgtask_async_engine) as session:
        await set_schedule_async(session, "minutely", task="job", cron="* * * * *")
        await session.commit()
    connection = held(pgtask_async_engine)
    service = Schedules(interval=5.0, batch_size=10)
    try:
        async with connection.use() as c:
            first = await service.run_once(c)
        assert first is not None
        assert 0 < first <= 30  # 10:01 is due in about 30 s
        pgtask_clock.advance(60)
        async with connection.use() as c:
            second = await service.run_once(c)
        assert await scheduled(pgtask_async_engine, "minutely") == [
            datetime(2030, 6, 3, 10, 1, tzinfo=UTC)
        ]
        assert second is not None
        assert 0 < second <= 30
    finally:
        await connection.close()


async def test_the_service_returns_none_without_schedules(
    pgtask_async_engine: AsyncEngine,
) -> None:
    connection = held(pgtask_async_engine)
    try:
        async with connection.use() as c:
            assert await Schedules().run_once(c) is None
    finally:
        await connection.close()


async def test_the_maintenance_runner_materialises_when_database_time_passes(
    pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    set_now(pgtask_clock, T0)
    async with AsyncSession(pgtask_async_engine) as session:
        await set_schedule_async(session, "minutely", task="job", cron="* * * * *")
        await session.commit()
    connection = held(pgtask_async_engine)
    runner = MaintenanceRunner(connection, [Schedules(interval=0.2, batch_size=10)])
    loop = asyncio.create_task(runner.run())
    try:
        for step in range(1, 4):
            pgtask_clock.advance(60)
            runner.wake()
            want = [datetime(2030, 6, 3, 10, m, tzinfo=UTC) for m in range(1, step + 1)]

            async def caught_up(expected: list[datetime] = want) -> bool:
                return await scheduled(pgtask_async_engine, "minutely") == expected

            await wait_until(caught_up, timeout=30.0, message=f"occurrence {step}")
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await connection.close()


def _registry(cron: str) -> Registry:
    registry = Registry()

    @registry.schedule("report", cron=cron, payload={"kind": "daily"}, misfire="skip")
    @registry.task("report", queue="reports", version=2)
    async def report(ctx: object, payload: object) -> None:
        return None

    return registry


async def test_declared_schedules_are_reconciled_keeping_unchanged_cursors(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    set_now(pgtask_clock, T0)
    registry = _registry("0 * * * *")
    assert [s.name for s in registry.schedules] == ["report"]
    async with pgtask_async_engine.begin() as connection:
        [info] = await reconcile_schedules(connection, registry)
    assert (info.declared, info.queue, info.version, info.task_name) == (True, "reports", 2,
                                                                         "report")
    assert info.next_run_at == datetime(2030, 6, 3, 11, tzinfo=UTC)
    pgtask_clock.advance(2 * 3600)  # a restart two hours later: same definition, same cursor
    async with pgtask_async_engine.begin() as connection:
        [again] = await reconcile_schedules(connection, _registry("0 * * * *"))
    assert again.next_run_at == info.next_run_at
    async with pgtask_async_engine.begin() as connection:
        [changed] = await reconcile_schedules(connection, _registry("30 * * * *"))
        audits = (await connection.execute(select(func.count()).select_from(AuditEntry)))
        # Deployment, not administration: reconciling writes no audit entry.
        assert audits.scalar_one() == 0
    assert changed.next_run_at == datetime(2030, 6, 3, 12, 30, tzinfo=UTC)


async def test_a_worker_reconciles_its_declared_schedules_at_start_and_runs_them(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    ran = asyncio.Event()

    @registry.schedule("pulse", every=1.0)
    @registry.task("pulse-job")
    async def pulse(ctx: object, payload: object) -> None:
        ran.set()

    options = WorkerOptions(lease_duration=3.0, schedule_interval=0.5)
    async with running_worker(registry, pgtask_async_engine, options):
        await asyncio.wait_for(ran.wait(), 30)
    async with pgtask_async_engine.connect() as connection:
        declared = (
            await connection.execute(select(Schedule.declared).where(Schedule.name == "pulse"))
        ).scalar_one()
    assert declared is True
    assert await scheduled(pgtask_async_engine, "pulse")


async def test_a_new_schedule_wakes_a_worker_resting_for_its_interval(
    pgtask_async_engine: AsyncEngine,
) -> None:
    # The materialiser rests for ten minutes (SLOW_POLL) once nothing is due: the first
    # occurrence of a schedule created meanwhile gets its task within PATIENCE only because
    # set_schedule's commit notified the workers.
    registry = Registry()

    @registry.task("pulse-job")
    async def pulse(ctx: object, payload: object) -> None:
        return None

    async with AsyncSession(pgtask_async_engine) as session:
        now = (await session.execute(select(NOW))).scalar_one()
        await set_schedule_async(session, "marker", task="other", every=3600,
                                 start_at=now - timedelta(seconds=1))
        await session.commit()
    options = WorkerOptions(lease_duration=3.0, schedule_interval=SLOW_POLL)
    async with running_worker(registry, pgtask_async_engine, options):
        async def rested() -> bool:  # its first pass is over: nothing is due for an hour
            return bool(await scheduled(pgtask_async_engine, "marker"))

        await wait_until(rested, PATIENCE, message="the first pass")
        async with AsyncSession(pgtask_async_engine) as session:
            info = await set_schedule_async(session, "pulse", task="pulse-job", every=1)
            await session.commit()

        async def first() -> bool:
            return info.next_run_at in await scheduled(pgtask_async_engine, "pulse")

        await wait_until(first, PATIENCE, message="the first occurrence's task")


async def test_occurrences_and_options_are_computed_off_the_event_loop(
    pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Finding occurrences in a time zone is computation (it took seconds for an expression
    # that only falls into daylight-saving gaps): the loop that renews leases never waits
    # for it, neither in the materialiser nor in set_schedule_async.
    calls: list[tuple[str, int]] = []

    def spied(kind: str, real: Callable[..., _T]) -> Callable[..., _T]:
        def call(*args: Any, **kwargs: Any) -> _T:
            calls.append((kind, threading.get_ident()))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr("sqlalchemy_pgtask.schedule.materialize.plan_occurrences",
                        spied("plan", plan_occurrences))
    monkeypatch.setattr("sqlalchemy_pgtask.schedule.api.schedule_spec",
                        spied("check", schedule_spec))
    set_now(pgtask_clock, T0)
    async with AsyncSession(pgtask_async_engine) as session:
        await set_schedule_async(session, "minutely", task="job", cron="* * * * *")
        await set_schedule_async(session, "gaps", task="job", cron="* * * * *")
        # Stored as no check would let it be: its occurrences would all fall into gaps.
        await session.execute(update(Schedule).where(Schedule.name == "gaps").values(
            cron="* * 2 * 3 0#5", timezone="Europe/Berlin"))
        await session.commit()
    pgtask_clock.advance(60)
    connection = held(pgtask_async_engine)
    try:
        async with connection.use() as c:
            await Schedules(interval=5.0, batch_size=10).run_once(c)
    finally:
        await connection.close()
    assert await scheduled(pgtask_async_engine, "minutely") == [
        datetime(2030, 6, 3, 10, 1, tzinfo=UTC)
    ]
    async with AsyncSession(pgtask_async_engine) as session:
        gaps = await get_schedule_async(session, "gaps")
    assert gaps is not None
    assert "no occurrence within 50 years" in (gaps.last_error or "")
    assert {kind for kind, _ in calls} == {"plan", "check"}
    assert threading.get_ident() not in {thread for _, thread in calls}


def test_declaring_a_schedule_checks_its_options_at_import_time() -> None:
    registry = Registry()
    with pytest.raises(InvalidOptionError):

        @registry.schedule("bad", cron="not a cron")
        @registry.task("job")
        def job(ctx: object, payload: object) -> None:
            return None

    @registry.task("other")
    def other(ctx: object, payload: object) -> None:
        return None

    registry.add_schedule("twice", other, every=timedelta(minutes=5))
    with pytest.raises(InvalidOptionError):
        registry.add_schedule("twice", other, every=60)


async def test_the_async_api_joins_the_callers_transaction(
    pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    set_now(pgtask_clock, T0)
    async with AsyncSession(pgtask_async_engine) as session:
        await set_schedule_async(session, "a", task="job", every=30)
        await session.rollback()  # never committed by the library
        assert await get_schedule_async(session, "a") is None
        await set_schedule_async(session, "a", task="job", every=30, actor="me")
        await pause_schedule_async(session, "a")
        await resume_schedule_async(session, "a")
        await session.commit()
        assert [s.name for s in await list_schedules_async(session)] == ["a"]
    pgtask_clock.advance(31)
    report = await materialize_schedules_async(pgtask_async_engine)
    assert report.created == 1
    async with AsyncSession(pgtask_async_engine) as session:
        await delete_schedule_async(session, "a", reason="done")
        await session.commit()
        assert await list_schedules_async(session) == []


async def test_the_async_materialiser_leaves_excluded_schedules_alone(
    pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    set_now(pgtask_clock, T0)
    async with AsyncSession(pgtask_async_engine) as session:
        await set_schedule_async(session, "kept", task="job", cron="* * * * *")
        await set_schedule_async(session, "left", task="job", cron="* * * * *")
        await session.commit()
    pgtask_clock.advance(60)
    report = await materialize_schedules_async(pgtask_async_engine, exclude=["left"])
    assert report.created == 1
    assert await scheduled(pgtask_async_engine, "left") == []
    assert len(await scheduled(pgtask_async_engine, "kept")) == 1
