"""Large `enqueue_many` batches go by ``COPY``: same transaction, same guarantees.

A batch of `COPY_MIN_ROWS` or more requests without idempotency keys or delays is sent with
``COPY`` on the caller's connection instead of one ``INSERT``: it commits or rolls back with
the caller's transaction, capacity is enforced all or nothing by the same insert trigger,
workers are woken by the same notification, and every value arrives exactly as validated.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    QueueFull,
    Task,
    configure_queue,
    enqueue_many,
    enqueue_many_async,
)
from sqlalchemy_pgtask.enqueue.copy import COPY_MIN_ROWS
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support.engines import lose, statements_of, terminate_backend
from tests.support.urls import libpq_url
from tests.support.waiting import PATIENCE

#: Text COPY escapes these; each must arrive unchanged.
AWKWARD = "tab\there\nnewline\\backslash \\N not null \r é 日本 \"quoted\""


def requests(count: int, **options: object) -> list[EnqueueRequest]:
    return [
        EnqueueRequest(name="bulk", payload={"i": i, "text": AWKWARD}, **options)  # type: ignore[arg-type]
        for i in range(count)
    ]


def count_tasks(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(Task)).scalar_one()


def test_a_large_batch_is_copied_with_no_statement_and_every_value_intact(
    pgtask_engine: Engine,
) -> None:
    sent = statements_of(pgtask_engine)
    batch = [
        EnqueueRequest(
            name="bulk", payload={"i": i, "text": AWKWARD}, queue="bulk-q", version=3,
            priority=-7, max_attempts=9, timeout=2.5, headers={"trace": AWKWARD},
        )
        for i in range(COPY_MIN_ROWS)
    ]
    with Session(pgtask_engine) as session:
        results = enqueue_many(session, batch)
        assert sent == []  # COPY, not a statement through the engine
        session.commit()

    assert all(result.created for result in results)
    with Session(pgtask_engine) as session:
        rows = {t.id: t for t in session.scalars(select(Task))}
    assert [rows[r.id].payload for r in results] == [{"i": i, "text": AWKWARD} for i in range(100)]
    first = rows[results[0].id]
    assert (first.queue, first.name, first.version, first.priority, first.max_attempts) == (
        "bulk-q", "bulk", 3, -7, 9,
    )
    assert first.timeout_seconds == 2.5
    assert first.headers == {"trace": AWKWARD}
    assert first.state == "pending"


def test_a_batch_below_the_threshold_is_one_statement(pgtask_engine: Engine) -> None:
    sent = statements_of(pgtask_engine)
    with Session(pgtask_engine) as session:
        enqueue_many(session, requests(COPY_MIN_ROWS - 1))
        session.commit()
    assert len(sent) == 1
    assert count_tasks(pgtask_engine) == COPY_MIN_ROWS - 1


@pytest.mark.parametrize(
    "options",
    [{"delay": 5.0}, {"idempotency_key": "k"}],
    ids=["delay", "idempotency-key"],
)
def test_delays_and_idempotency_keys_keep_the_statement(
    pgtask_engine: Engine, options: dict[str, object]
) -> None:
    sent = statements_of(pgtask_engine)
    batch = [*requests(COPY_MIN_ROWS - 1), EnqueueRequest(name="bulk", **options)]  # type: ignore[arg-type]
    with Session(pgtask_engine) as session:
        enqueue_many(session, batch)
        session.commit()
    assert len(sent) == 1


def test_explicit_and_default_run_at_are_copied_together(pgtask_engine: Engine) -> None:
    later = datetime(2031, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    sent = statements_of(pgtask_engine)
    with Session(pgtask_engine) as session:
        copied = enqueue_many(session, requests(COPY_MIN_ROWS, run_at=later))
        mixed = enqueue_many(session, requests(COPY_MIN_ROWS - 1) + requests(1, run_at=later))
        assert sent == []  # both copied
        now = session.scalar(select(func.pgtask.now()))
        session.commit()
        assert session.get(Task, copied[-1].id).run_at == later  # type: ignore[union-attr]
        assert session.get(Task, mixed[-1].id).run_at == later  # type: ignore[union-attr]
        default = session.get(Task, mixed[0].id).run_at  # type: ignore[union-attr]
    assert default is not None
    assert now is not None
    assert default <= now


def test_copied_tasks_follow_the_moved_database_clock(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    # Like the statement's run_at, a copied task's is pgtask.now(), not the column default.
    pgtask_clock.advance(3 * 86_400)
    with Session(pgtask_engine) as session:
        copied = enqueue_many(session, requests(COPY_MIN_ROWS))
        inserted = enqueue_many(session, requests(1))
        session.commit()
        run_ats = {
            task_id: session.get(Task, task_id).run_at  # type: ignore[union-attr]
            for task_id in (copied[0].id, inserted[0].id)
        }
    real = datetime.now(timezone.utc)
    copied_at, inserted_at = run_ats[copied[0].id], run_ats[inserted[0].id]
    assert copied_at > real + timedelta(days=2)
    assert abs(copied_at - inserted_at) < timedelta(minutes=5)


def test_a_copied_batch_rolls_back_with_the_callers_transaction(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as connection:  # no transaction begun yet
        enqueue_many(connection, requests(150))
        assert connection.in_transaction()
        connection.rollback()
    assert count_tasks(pgtask_engine) == 0


def test_a_copied_batch_over_capacity_writes_nothing(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "default", max_outstanding_tasks=COPY_MIN_ROWS + 20)
        enqueue_many(session, requests(20))
        session.commit()
    with Session(pgtask_engine) as session, pytest.raises(QueueFull):
        enqueue_many(session, requests(COPY_MIN_ROWS + 1))
    assert count_tasks(pgtask_engine) == 20
    with Session(pgtask_engine) as session:  # exactly the room that is left still fits
        enqueue_many(session, requests(COPY_MIN_ROWS))
        session.commit()
    assert count_tasks(pgtask_engine) == COPY_MIN_ROWS + 20


def test_a_copied_batch_wakes_listening_workers_at_commit(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    with psycopg.connect(libpq_url(pgtask_database_url), autocommit=True) as listener:
        listener.execute("LISTEN pgtask_ready")
        with Session(pgtask_engine) as session:
            enqueue_many(session, requests(COPY_MIN_ROWS))
            session.commit()
        payloads = [n.payload for n in listener.notifies(timeout=PATIENCE, stop_after=1)]
    assert payloads == ["default"]


async def test_the_async_twin_copies_too(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    sent = statements_of(pgtask_async_engine.sync_engine)
    async with AsyncSession(pgtask_async_engine) as session:
        results = await enqueue_many_async(session, requests(COPY_MIN_ROWS))
        assert sent == []
        await session.commit()
    with Session(pgtask_engine) as session:
        stored = session.scalars(select(Task.id).order_by(Task.id)).all()
    assert sorted(r.id for r in results) == stored
    assert all(isinstance(r.id, uuid.UUID) for r in results)


async def test_the_async_twin_rolls_back(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    async with pgtask_async_engine.connect() as connection:
        await enqueue_many_async(connection, requests(COPY_MIN_ROWS))
        await connection.rollback()
    assert count_tasks(pgtask_engine) == 0


def test_copied_tasks_get_database_time_as_run_at(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        began = session.scalar(select(func.now()))
        enqueue_many(session, requests(COPY_MIN_ROWS))
        after = session.scalar(select(func.clock_timestamp()))
        session.commit()
    with Session(pgtask_engine) as session:
        earliest, latest = session.execute(
            select(func.min(Task.run_at), func.max(Task.run_at))
        ).one()
    assert began is not None
    assert after is not None
    # The COPY's statement time, the same for every row, as an INSERT's would be.
    assert earliest == latest
    assert began <= earliest <= after


def test_a_connection_lost_before_the_copy_is_invalidated_as_for_a_statement(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.connect() as victim:
        lose(victim)
        with pytest.raises(DBAPIError) as caught:
            enqueue_many(victim, requests(COPY_MIN_ROWS))
        assert caught.value.connection_invalidated
        assert victim.invalidated
        victim.rollback()  # failed on a lost connection that was not invalidated
    with Session(pgtask_engine) as session:  # the pool replaced it
        enqueue_many(session, requests(COPY_MIN_ROWS))
        session.commit()
    assert count_tasks(pgtask_engine) == COPY_MIN_ROWS


async def test_the_async_twin_invalidates_a_lost_connection_too(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    async with pgtask_async_engine.connect() as victim:
        pid = (await victim.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await victim.commit()
        terminate_backend(pgtask_engine, pid)
        with pytest.raises(DBAPIError) as caught:
            await enqueue_many_async(victim, requests(COPY_MIN_ROWS))
        assert caught.value.connection_invalidated
        assert victim.invalidated
        await victim.rollback()


def test_a_connection_in_another_client_encoding_keeps_the_statement(
    pgtask_engine: Engine,
) -> None:
    # COPY encodes rows as it sends them, and an encoding error there aborts the caller's
    # transaction; the statement fails before sending anything.
    sent = statements_of(pgtask_engine)
    with pgtask_engine.connect() as connection:
        connection.exec_driver_sql("SET client_encoding TO 'LATIN1'")
        with pytest.raises(UnicodeEncodeError):
            enqueue_many(connection, requests(COPY_MIN_ROWS))  # AWKWARD holds 日本
        assert connection.execute(text("SELECT 1")).scalar_one() == 1  # still usable
        sent.clear()
        enqueue_many(connection, [
            EnqueueRequest(name="bulk", payload={"i": i, "text": "é"})
            for i in range(COPY_MIN_ROWS)
        ])
        assert len(sent) == 1  # one statement, not COPY
        connection.exec_driver_sql("RESET client_encoding")  # before the pool hands it on
        connection.commit()
    with Session(pgtask_engine) as session:
        payloads = session.scalars(select(Task.payload)).all()
    assert sorted(p["i"] for p in payloads) == list(range(COPY_MIN_ROWS))
    assert {p["text"] for p in payloads} == {"é"}
