"""Queue settings: capacity limits counted exactly, pause, retention values, listing."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from sqlalchemy import Engine, event, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    InvalidOptionError,
    Queue,
    QueueFull,
    QueueSettings,
    Task,
    configure_queue,
    configure_queue_async,
    enqueue,
    enqueue_many,
    enqueue_many_async,
    list_queues,
    list_queues_async,
)


def test_configure_queue_creates_a_row_with_defaults(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        row = configure_queue(session, "reports")
        session.commit()
    assert row["name"] == "reports"
    assert row["max_outstanding_tasks"] is None
    assert row["terminal_retention_seconds"] == 7 * 24 * 3600
    assert row["idempotency_retention_seconds"] == 30 * 24 * 3600
    assert row["paused_at"] is None


def test_turning_a_limit_on_counts_the_tasks_already_outstanding(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        enqueue_many(session, [EnqueueRequest(name="t", queue="q") for _ in range(3)])
        done = enqueue(session, "t", queue="q").id
        session.execute(
            update(Task).where(Task.id == done)
            .values(state="succeeded", completed_at=func.statement_timestamp())
        )
        session.commit()
        row = configure_queue(session, "q", max_outstanding_tasks=4)
        session.commit()
        assert row["outstanding_tasks"] == 3  # the finished task does not count
        enqueue(session, "t", queue="q")
        session.commit()
        with pytest.raises(QueueFull):
            enqueue(session, "t", queue="q")
        session.rollback()


def test_removing_the_limit_stops_counting(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "q", max_outstanding_tasks=1)
        enqueue(session, "t", queue="q")
        session.commit()
        row = configure_queue(session, "q", max_outstanding_tasks=None)
        session.commit()
        assert (row["max_outstanding_tasks"], row["outstanding_tasks"]) == (None, 0)
        enqueue_many(session, [EnqueueRequest(name="t", queue="q") for _ in range(5)])
        session.commit()
        assert session.get_one(Queue, "q").outstanding_tasks == 0


def test_only_the_options_passed_change(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "q", max_outstanding_tasks=7, terminal_retention_seconds=60)
        first_pause = configure_queue(session, "q", paused=True)["paused_at"]
        again = configure_queue(session, "q", paused=True)
        session.commit()
        assert again["paused_at"] == first_pause  # pausing twice keeps the first time
        assert (again["max_outstanding_tasks"], again["terminal_retention_seconds"]) == (7, 60)
        resumed = configure_queue(session, "q", paused=False)
        session.commit()
    assert resumed["paused_at"] is None
    assert resumed["max_outstanding_tasks"] == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_outstanding_tasks": 0},
        {"terminal_retention_seconds": -1},
        {"idempotency_retention_seconds": 1.5},
        {"paused": "yes"},
    ],
)
def test_bad_settings_are_rejected_before_any_write(
    pgtask_engine: Engine, kwargs: dict[str, object]
) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(InvalidOptionError):
            configure_queue(session, "q", **kwargs)  # type: ignore[arg-type]
        assert not session.in_transaction()
        assert session.scalar(select(func.count()).select_from(Queue)) == 0


# -- reading settings ----------------------------------------------------------------------


def test_list_queues_reads_typed_rows_by_name_in_the_callers_transaction(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "reports", max_outstanding_tasks=3, paused=True)
        configure_queue(session, "emails", terminal_retention_seconds=60)
        listed = list_queues(session)  # uncommitted rows: the caller's own transaction
        session.rollback()
        assert list_queues(session) == []
    assert [q.name for q in listed] == ["emails", "reports"]
    emails, reports = listed
    assert isinstance(reports, QueueSettings)
    assert (reports.max_outstanding_tasks, reports.outstanding_tasks, reports.paused) == (
        3, 0, True,
    )
    assert (emails.max_outstanding_tasks, emails.paused, emails.terminal_retention_seconds) == (
        None, False, 60,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        reports.name = "other"  # type: ignore[misc]


def test_queue_settings_has_exactly_the_queue_tables_columns() -> None:
    # A migration that adds a column to pgtask.queues must add it here too.
    assert {f.name for f in dataclasses.fields(QueueSettings)} == set(Queue.__table__.c.keys())


async def test_the_async_twins_configure_and_list_in_the_callers_transaction(
    pgtask_async_engine: AsyncEngine,
) -> None:
    async with AsyncSession(pgtask_async_engine) as session:
        await enqueue_many_async(session, [EnqueueRequest(name="t", queue="q")] * 2)
        row = await configure_queue_async(session, "q", max_outstanding_tasks=5)
        assert row["outstanding_tasks"] == 2  # counted in the caller's transaction
        await session.commit()
        (listed,) = await list_queues_async(session)
    assert (listed.name, listed.max_outstanding_tasks, listed.outstanding_tasks) == ("q", 5, 2)
    async with pgtask_async_engine.connect() as connection:
        await configure_queue_async(connection, "q", paused=True)
        assert (await list_queues_async(connection))[0].paused
        await connection.rollback()
        assert not (await list_queues_async(connection))[0].paused


# -- a capacity limit needs READ COMMITTED --------------------------------------------------


@pytest.mark.parametrize(
    "isolation", ["REPEATABLE READ", "SERIALIZABLE", "SET TRANSACTION REPEATABLE READ"]
)
def test_turning_a_limit_on_outside_read_committed_is_refused_before_any_sql(
    pgtask_engine: Engine, isolation: str
) -> None:
    set_by_statement = isolation.startswith("SET TRANSACTION")
    engine = pgtask_engine if set_by_statement else pgtask_engine.execution_options(
        isolation_level=isolation
    )
    seen: list[str] = []
    with Session(engine) as session:
        if set_by_statement:
            session.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        enqueue(session, "t", queue="q")  # the snapshot the recount would have used
        event.listen(pgtask_engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
        with pytest.raises(InvalidOptionError, match="READ COMMITTED") as caught:
            configure_queue(session, "q", max_outstanding_tasks=5)
        assert caught.value.field == "max_outstanding_tasks"
        assert seen == []
        # The transaction is usable, and settings that recount nothing are allowed.
        assert configure_queue(session, "q", paused=True)["max_outstanding_tasks"] is None
        enqueue(session, "t", queue="q")
        session.commit()
        assert session.scalar(select(func.count()).select_from(Task)) == 2


async def test_the_async_twin_refuses_a_limit_outside_read_committed_too(
    pgtask_async_engine: AsyncEngine,
) -> None:
    engine = pgtask_async_engine.execution_options(isolation_level="SERIALIZABLE")
    async with AsyncSession(engine) as session:
        with pytest.raises(InvalidOptionError) as caught:
            await configure_queue_async(session, "q", max_outstanding_tasks=1)
        assert caught.value.field == "max_outstanding_tasks"
        await configure_queue_async(session, "q", max_outstanding_tasks=None)
        await session.commit()


def test_read_committed_is_the_default_and_limits_are_counted_there(
    pgtask_engine: Engine,
) -> None:
    read_committed = pgtask_engine.execution_options(isolation_level="READ COMMITTED")
    with Session(read_committed) as session:
        enqueue(session, "t", queue="q")
        session.commit()
        assert configure_queue(session, "q", max_outstanding_tasks=5)["outstanding_tasks"] == 1
        session.commit()


# -- rate limit and starvation timeout -------------------------------------------------------


def test_rate_limit_and_starvation_timeout_round_trip(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        row = configure_queue(session, "q", rate_limit=100)
        assert (row["rate_limit"], row["rate_period_seconds"]) == (100, 1.0)  # per second
        configure_queue(
            session, "q", rate_limit=5000, rate_period=timedelta(hours=1),
            starvation_timeout=timedelta(minutes=5),
        )
        session.commit()
        [listed] = list_queues(session)
        assert (listed.rate_limit, listed.rate_period_seconds) == (5000, 3600.0)
        assert listed.starvation_timeout_seconds == 300.0

        # Other options leave them alone; the period alone cannot be changed.
        configure_queue(session, "q", max_outstanding_tasks=3, starvation_timeout=0.5)
        [listed] = list_queues(session)
        assert (listed.rate_limit, listed.rate_period_seconds) == (5000, 3600.0)
        assert listed.starvation_timeout_seconds == 0.5

        row = configure_queue(session, "q", rate_limit=None, starvation_timeout=None)
        session.commit()
    assert (row["rate_limit"], row["rate_period_seconds"]) == (None, None)
    assert row["starvation_timeout_seconds"] is None


def test_a_rate_limit_without_a_period_means_per_second_again(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "q", rate_limit=10, rate_period=30.0)
        row = configure_queue(session, "q", rate_limit=20)
        session.commit()
    assert (row["rate_limit"], row["rate_period_seconds"]) == (20, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_limit": 0}, "rate_limit"),
        ({"rate_limit": -5}, "rate_limit"),
        ({"rate_limit": 2**31}, "rate_limit"),
        ({"rate_limit": 1.5}, "rate_limit"),
        ({"rate_limit": True}, "rate_limit"),
        ({"rate_limit": 5, "rate_period": 0}, "rate_period"),
        ({"rate_limit": 5, "rate_period": -1.0}, "rate_period"),
        # Accepted before, and then every claim's token refill overflowed (a DataError).
        ({"rate_limit": 5, "rate_period": 1e-300}, "rate_period"),
        ({"rate_limit": 5, "rate_period": timedelta(microseconds=999)}, "rate_period"),
        ({"rate_limit": 5, "rate_period": float("nan")}, "rate_period"),
        ({"rate_limit": 5, "rate_period": float("inf")}, "rate_period"),
        ({"rate_limit": 5, "rate_period": None}, "rate_period"),
        ({"rate_limit": 5, "rate_period": "1s"}, "rate_period"),
        ({"rate_limit": 5, "rate_period": timedelta(days=40000)}, "rate_period"),
        ({"rate_period": 10.0}, "rate_period"),  # the period alone
        ({"rate_limit": None, "rate_period": 10.0}, "rate_period"),
        ({"starvation_timeout": 0}, "starvation_timeout"),
        ({"starvation_timeout": -1}, "starvation_timeout"),
        ({"starvation_timeout": timedelta(0)}, "starvation_timeout"),
        ({"starvation_timeout": float("nan")}, "starvation_timeout"),
        ({"starvation_timeout": "5"}, "starvation_timeout"),
    ],
)
def test_bad_rate_or_starvation_settings_are_rejected_before_any_sql(
    pgtask_engine: Engine, kwargs: dict[str, object], field: str
) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(InvalidOptionError) as refused:
            configure_queue(session, "q", **kwargs)  # type: ignore[arg-type]
        assert refused.value.field == field
        assert not session.in_transaction()


async def test_the_async_twin_sets_rate_and_starvation(pgtask_async_engine: AsyncEngine) -> None:
    async with AsyncSession(pgtask_async_engine) as session:
        await configure_queue_async(
            session, "q", rate_limit=7, rate_period=60, starvation_timeout=12.5
        )
        await session.commit()
        [listed] = await list_queues_async(session)
    assert (listed.rate_limit, listed.rate_period_seconds) == (7, 60.0)
    assert listed.starvation_timeout_seconds == 12.5
