"""Transactional enqueue: the task commits or rolls back with the caller's transaction."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    Table,
    Uuid,
    any_,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    IdempotencyConflict,
    IdempotencyKey,
    Queue,
    QueueFull,
    Task,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from sqlalchemy_pgtask._driver_sql import driver_statement, execute
from sqlalchemy_pgtask.statements import ENQUEUE_ONE, ENQUEUE_PLAIN
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support.engines import lose, statements_of
from tests.support.urls import libpq_url
from tests.support.waiting import PATIENCE, wait_until


def task_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(Task)).scalar_one()


# -- commit and rollback, for every kind of bind -------------------------------------------


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_session_enqueue_follows_the_business_transaction(
    pgtask_engine: Engine, outcome: str
) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="business-row"))  # stands in for the caller's own data
        result = enqueue(session, "send-receipt", {"order": 1})
        getattr(session, outcome)()
    assert result.created
    expected = 1 if outcome == "commit" else 0
    assert task_count(pgtask_engine) == expected
    with pgtask_engine.connect() as connection:
        queues = connection.execute(select(func.count()).select_from(Queue)).scalar_one()
    assert queues == expected


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_connection_enqueue_follows_the_business_transaction(
    pgtask_engine: Engine, outcome: str
) -> None:
    with pgtask_engine.connect() as connection:
        enqueue(connection, "send-receipt", {"order": 1})
        getattr(connection, outcome)()
    assert task_count(pgtask_engine) == (1 if outcome == "commit" else 0)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
async def test_async_session_enqueue_follows_the_business_transaction(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine, outcome: str
) -> None:
    async with AsyncSession(pgtask_async_engine) as session:
        await enqueue_async(session, "send-receipt", {"order": 1})
        await enqueue_many_async(session, [EnqueueRequest(name="audit", payload=2)])
        await getattr(session, outcome)()
    assert task_count(pgtask_engine) == (2 if outcome == "commit" else 0)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
async def test_async_connection_enqueue_follows_the_business_transaction(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine, outcome: str
) -> None:
    async with pgtask_async_engine.connect() as connection:
        await enqueue_async(connection, "send-receipt", {"order": 1})
        await getattr(connection, outcome)()
    assert task_count(pgtask_engine) == (1 if outcome == "commit" else 0)


def test_enqueue_is_invisible_to_others_until_commit(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        enqueue(session, "t", None)
        assert task_count(pgtask_engine) == 0
        session.commit()
    assert task_count(pgtask_engine) == 1


def test_enqueue_neither_flushes_nor_commits_the_session(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        pending = Queue(name="not-flushed")
        session.add(pending)
        enqueue(session, "t", None)
        assert pending in session.new  # still unflushed
        assert session.in_transaction()
        session.rollback()
    assert task_count(pgtask_engine) == 0


def test_enqueue_uses_one_statement_and_opens_no_connection(pgtask_engine: Engine) -> None:
    statements: list[str] = []
    checkouts: list[object] = []
    event.listen(pgtask_engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    event.listen(pgtask_engine.pool, "checkout", lambda *a: checkouts.append(a))
    with pgtask_engine.connect() as connection:
        connection.execute(text("SELECT 1"))
        statements.clear()
        checkouts.clear()
        enqueue(connection, "t", {"a": 1})
        enqueue_many(connection, [EnqueueRequest(name="t", payload=i) for i in range(50)])
        connection.commit()
    assert len(statements) == 2
    assert checkouts == []


# -- what gets stored ----------------------------------------------------------------------


def test_enqueue_stores_every_option(pgtask_engine: Engine) -> None:
    run_at = datetime(2031, 5, 17, 8, 30, tzinfo=timezone.utc)
    with Session(pgtask_engine) as session:
        result = enqueue(
            session, "report.build", {"id": [1, 2]}, queue="reports", version=3,
            run_at=run_at, priority=-7, max_attempts=9, headers={"traceparent": "00-x"},
        )
        session.commit()
        task = session.get_one(Task, result.id)
    assert (task.name, task.queue, task.version, task.payload) == (
        "report.build", "reports", 3, {"id": [1, 2]},
    )
    assert (task.state, task.priority, task.max_attempts, task.attempt) == ("pending", -7, 9, 0)
    assert task.run_at == run_at
    assert task.headers == {"traceparent": "00-x"}
    assert task.failed_attempts == 0
    assert task.idempotency_key is None


def test_defaults_queue_version_priority_and_attempts(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        task = session.get_one(Task, enqueue(session, "t").id)
    # max_attempts stays unset until the first claim fills in the registered handler's.
    assert (task.queue, task.version, task.priority, task.max_attempts) == (
        "default", 1, 0, None,
    )
    assert task.payload is None
    assert task.headers == {}


@pytest.mark.parametrize("delay", [90, 90.0, timedelta(seconds=90)])
def test_delay_is_resolved_with_database_time(pgtask_engine: Engine, delay: Any) -> None:
    with Session(pgtask_engine) as session:
        # Inside a transaction that began earlier, "now" must still be the statement's time.
        session.execute(text("SELECT pg_sleep(0.05)"))
        task_id = enqueue(session, "t", None, delay=delay).id
        session.commit()
        run_at, created_at = session.execute(
            select(Task.run_at, Task.created_at).where(Task.id == task_id)
        ).one()
    # created_at is the server's statement_timestamp() of the same INSERT.
    assert run_at - created_at == timedelta(seconds=90)


def test_run_at_in_the_past_is_allowed(pgtask_engine: Engine) -> None:
    past = datetime(2001, 1, 1, tzinfo=timezone.utc)
    with Session(pgtask_engine) as session:
        task = session.get_one(Task, enqueue(session, "t", run_at=past).id)
    assert task.run_at == past


def test_enqueue_many_returns_results_in_order_in_one_round_trip(pgtask_engine: Engine) -> None:
    requests = [EnqueueRequest(name=f"t{i}", payload={"i": i}, priority=i) for i in range(200)]
    with Session(pgtask_engine) as session:
        results = enqueue_many(session, requests)
        session.commit()
        stored = {row.id: row.payload for row in session.execute(select(Task.id, Task.payload))}
    assert [stored[r.id] for r in results] == [{"i": i} for i in range(200)]
    assert all(r.created for r in results)
    assert len({r.id for r in results}) == 200


def test_enqueue_many_of_nothing_runs_no_sql(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as connection:
        assert enqueue_many(connection, []) == []
        assert not connection.in_transaction()


def test_enqueue_many_is_all_or_nothing_when_the_database_rejects_one(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="tiny", max_outstanding_tasks=4))
        session.commit()
    with Session(pgtask_engine) as session:
        with pytest.raises(QueueFull):
            enqueue_many(session, [EnqueueRequest(name="t", queue="tiny") for _ in range(5)])
        session.rollback()
    assert task_count(pgtask_engine) == 0


# -- notifications -------------------------------------------------------------------------


def _listener(database_url: str) -> psycopg.Connection[Any]:
    listener = psycopg.connect(libpq_url(database_url), autocommit=True)
    listener.execute("LISTEN pgtask_ready")
    return listener


def test_committed_enqueue_notifies_once_per_queue(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    with _listener(pgtask_database_url) as listener:
        with Session(pgtask_engine) as session:
            enqueue_many(
                session,
                [EnqueueRequest(name="t", queue=q) for q in ["a", "a", "b", "a", "b"]],
            )
            enqueue(session, "t", queue="a")
            session.commit()
        with Session(pgtask_engine) as session:
            enqueue(session, "t", queue="rolled-back")
            session.rollback()
        payloads = sorted(n.payload for n in listener.notifies(timeout=1.0, stop_after=10))
    assert payloads == ["a", "b"]


# -- capacity ------------------------------------------------------------------------------


def test_capacity_raises_pt001_and_frees_when_a_task_finishes(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="small", max_outstanding_tasks=2))
        session.commit()
        first = enqueue(session, "t", queue="small").id
        enqueue(session, "t", queue="small")
        session.commit()
        with pytest.raises(QueueFull, match="capacity of 2") as caught:
            enqueue(session, "t", queue="small")
        cause = caught.value.__cause__
        assert isinstance(cause, DBAPIError)
        assert getattr(cause.orig, "sqlstate", None) == "PT001"
        session.rollback()
        # A terminal transition frees one slot, whoever writes it.
        session.execute(
            update(Task).where(Task.id == first)
            .values(state="cancelled", completed_at=func.statement_timestamp())
        )
        enqueue(session, "t", queue="small")
        session.commit()
        assert session.get_one(Queue, "small").outstanding_tasks == 2
    assert task_count(pgtask_engine) == 3


def test_unlimited_queues_take_no_queue_row_lock(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="open"))
        session.commit()
    with pgtask_engine.connect() as holder:
        # Another transaction holds the queue row; an unlimited enqueue must not wait for it.
        holder.execute(select(Queue).where(Queue.name == "open").with_for_update())
        with pgtask_engine.connect() as producer:
            producer.execute(text("SET lock_timeout = '500ms'"))
            enqueue(producer, "t", queue="open")
            producer.commit()
        holder.rollback()
    assert task_count(pgtask_engine) == 1


# -- idempotency ---------------------------------------------------------------------------


def test_duplicate_key_returns_the_reserved_task(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        first = enqueue(session, "t", {"v": 1}, idempotency_key="order-7")
        session.commit()
        second = enqueue(session, "t", {"v": 2}, idempotency_key="order-7")
        session.commit()
        other_queue = enqueue(session, "t", {"v": 3}, queue="q2", idempotency_key="order-7")
        session.commit()
    assert first.created
    assert not second.created
    assert other_queue.created
    assert second.id == first.id
    assert other_queue.id != first.id
    assert task_count(pgtask_engine) == 2


def test_rolled_back_idempotent_enqueue_leaves_no_reservation(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        enqueue(session, "t", idempotency_key="k")
        session.rollback()
        assert session.scalar(select(func.count()).select_from(IdempotencyKey)) == 0
        again = enqueue(session, "t", idempotency_key="k")
        session.commit()
    assert again.created


def test_duplicate_keys_inside_one_batch_create_one_task(pgtask_engine: Engine) -> None:
    requests = [
        EnqueueRequest(name="t", payload=0, idempotency_key="same"),
        EnqueueRequest(name="t", payload=1),
        EnqueueRequest(name="t", payload=2, idempotency_key="same"),
    ]
    with Session(pgtask_engine) as session:
        results = enqueue_many(session, requests)
        session.commit()
    assert [r.created for r in results] == [True, True, False]
    assert results[2].id == results[0].id
    assert task_count(pgtask_engine) == 2


def test_concurrent_producers_of_one_key_create_exactly_one_task(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    producers = 10
    engine = create_engine(pgtask_database_url, pool_size=producers, max_overflow=0)
    barrier = threading.Barrier(producers)
    results: list[tuple[uuid.UUID, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def produce() -> None:
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))  # connected before the race starts
                barrier.wait(timeout=30)
                result = enqueue(connection, "t", idempotency_key="the-one")
                connection.commit()
            with lock:
                results.append((result.id, result.created))
        except BaseException as exc:  # reported below; a thread cannot raise into the test
            errors.append(exc)

    threads = [threading.Thread(target=produce) for _ in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    engine.dispose()
    assert errors == []
    assert len(results) == producers
    assert sum(created for _, created in results) == 1
    assert len({task_id for task_id, _ in results}) == 1
    assert task_count(pgtask_engine) == 1


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_key_taken_after_the_snapshot_is_an_idempotency_conflict_and_a_retry_dedupes(
    pgtask_engine: Engine, isolation: str
) -> None:
    with pgtask_engine.connect().execution_options(isolation_level=isolation) as late:
        late.execute(select(func.count()).select_from(Task))  # this transaction's snapshot
        with pgtask_engine.begin() as early:  # another producer commits the key after it
            first = enqueue(early, "t", idempotency_key="receipt-7").id
        with pytest.raises(IdempotencyConflict, match="retry the transaction") as caught:
            enqueue(late, "t", idempotency_key="receipt-7")
        cause = caught.value.__cause__
        assert getattr(getattr(cause, "orig", None), "sqlstate", None) == "40001"
        late.rollback()
        # The retried transaction sees the reservation and deduplicates as usual.
        assert enqueue(late, "t", idempotency_key="receipt-7") == (first, False)
        late.commit()
    assert task_count(pgtask_engine) == 1


async def test_an_async_idempotent_enqueue_under_repeatable_read_conflicts_the_same_way(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    engine = pgtask_async_engine.execution_options(isolation_level="REPEATABLE READ")
    async with AsyncSession(engine) as session:
        await session.execute(select(func.count()).select_from(Task))
        with pgtask_engine.begin() as early:
            enqueue(early, "t", idempotency_key="k")
        with pytest.raises(IdempotencyConflict):
            await enqueue_many_async(session, [EnqueueRequest(name="t", idempotency_key="k")])
        await session.rollback()
    assert task_count(pgtask_engine) == 1


def test_a_serialization_failure_without_keys_is_not_an_idempotency_conflict(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="limited", max_outstanding_tasks=10))
        session.commit()
    with pgtask_engine.connect().execution_options(isolation_level="REPEATABLE READ") as late:
        late.execute(select(func.count()).select_from(Task))
        with pgtask_engine.begin() as early:  # moves the queue's counter after the snapshot
            enqueue(early, "t", queue="limited")
        with pytest.raises(DBAPIError) as caught:
            enqueue(late, "t", queue="limited")
        assert getattr(caught.value.orig, "sqlstate", None) == "40001"
        late.rollback()


def _finish(session: Session, task_id: uuid.UUID, state: str = "succeeded") -> None:
    session.execute(
        update(Task).where(Task.id == task_id)
        .values(state=state, completed_at=func.statement_timestamp())
    )


def test_key_expires_retention_after_its_task_finishes(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="q", idempotency_retention_seconds=3600))
        task_id = enqueue(session, "t", queue="q", idempotency_key="k").id
        session.commit()
        _finish(session, task_id)
        session.commit()
        # Finished, but the key holds for the queue's retention (the key row is not touched:
        # its expiry is derived from the task).
        assert enqueue(session, "t", queue="q", idempotency_key="k") == (task_id, False)
        session.commit()
        pgtask_clock.advance(3590)
        assert enqueue(session, "t", queue="q", idempotency_key="k") == (task_id, False)
        session.commit()
        pgtask_clock.advance(20)  # an hour and ten seconds after the task finished
        again = enqueue(session, "t", queue="q", idempotency_key="k")
        session.commit()
    assert again.created
    assert again.id != task_id


def test_expired_reservation_is_reused_by_a_new_task(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="q", idempotency_retention_seconds=0))
        old = enqueue(session, "t", queue="q", idempotency_key="k").id
        session.commit()
        _finish(session, old, "failed")
        session.commit()
        new = enqueue(session, "t", queue="q", idempotency_key="k")
        session.commit()
        key = session.get_one(IdempotencyKey, ("q", "k"))
    assert new.created
    assert new.id != old
    assert key.task_id == new.id
    assert key.expires_at is None  # the new task is unfinished


def test_deleting_history_does_not_release_an_unexpired_key(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        first = enqueue(session, "t", idempotency_key="k").id
        session.commit()
        session.execute(delete(Task).where(Task.id == first))
        session.commit()
        again = enqueue(session, "t", idempotency_key="k")
        session.commit()
        key = session.get_one(IdempotencyKey, ("default", "k"))
    assert again == (first, False)
    assert key.expires_at is not None  # deletion started the retention clock
    assert task_count(pgtask_engine) == 0


def test_duplicate_succeeds_while_the_queue_is_full(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="one", max_outstanding_tasks=1))
        session.commit()
        first = enqueue(session, "t", queue="one", idempotency_key="k")
        session.commit()
        duplicate = enqueue(session, "t", queue="one", idempotency_key="k")
        session.commit()
    assert duplicate == (first.id, False)


# -- transaction left usable after bad input -----------------------------------------------


BadCall = Callable[[Session], object]


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: enqueue(s, "bad name"), id="invalid-name"),
        pytest.param(lambda s: enqueue_many(
            s, [EnqueueRequest(name="ok"), EnqueueRequest(name="ok", payload={1, 2})]
        ), id="batch-with-one-bad-payload"),
    ],
)
def test_bad_input_leaves_the_transaction_usable(pgtask_engine: Engine, call: BadCall) -> None:
    with Session(pgtask_engine) as session:
        enqueue(session, "before")
        with pytest.raises(ValueError, match=r"name|payload"):  # ValidationError is a ValueError
            call(session)
        enqueue(session, "after")
        session.commit()
        names = sorted(session.scalars(select(Task.name)).all())
    assert names == ["after", "before"]


def test_a_uniform_batch_sends_shared_options_once_and_stores_them_on_every_task(
    pgtask_engine: Engine,
) -> None:
    seen = statements_of(pgtask_engine)
    shared: dict[str, Any] = {
        "queue": "bulk", "version": 2, "priority": 3, "max_attempts": 7, "delay": 60,
        "headers": {"trace": "x"},
    }
    requests = [EnqueueRequest(name="resize", payload={"n": n}, **shared) for n in range(50)]
    with Session(pgtask_engine) as session:
        results = enqueue_many(session, requests)
        assert "ords" not in seen[-1]  # the shared options went as scalars, not arrays
        session.commit()
        rows = {
            row.id: row
            for row in session.execute(
                select(Task.id, Task.queue, Task.name, Task.version, Task.priority,
                       Task.max_attempts, Task.headers, Task.payload,
                       Task.run_at - Task.created_at)
            )
        }
    assert [rows[r.id].payload for r in results] == [{"n": n} for n in range(50)]
    assert {
        (row.queue, row.name, row.version, row.priority, row.max_attempts, row[6]["trace"],
         row[8])
        for row in rows.values()
    } == {("bulk", "resize", 2, 3, 7, "x", timedelta(seconds=60))}


def test_a_batch_with_one_different_option_still_stores_each_tasks_own(
    pgtask_engine: Engine,
) -> None:
    seen = statements_of(pgtask_engine)
    requests = [EnqueueRequest(name="t", payload=n, priority=0) for n in range(5)]
    requests.append(EnqueueRequest(name="t", payload=5, priority=9))
    with Session(pgtask_engine) as session:
        results = enqueue_many(session, requests)
        assert "ords" in seen[-1]  # the per-request arrays
        session.commit()
        priorities = {r.id: r.priority for r in session.execute(select(Task.id, Task.priority))}
    assert [priorities[r.id] for r in results] == [0, 0, 0, 0, 0, 9]


def test_a_key_taken_over_by_a_concurrent_producer_returns_its_task_not_the_expired_one(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        session.add(Queue(name="q", idempotency_retention_seconds=0))
        old = enqueue(session, "t", queue="q", idempotency_key="k").id
        session.commit()
        _finish(session, old)
        session.commit()

    def waiting_for_a_lock(count: int) -> bool:
        with pgtask_engine.connect() as conn:
            return bool(conn.execute(text(
                "SELECT count(*) >= :n FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ), {"n": count}).scalar_one())

    results: dict[str, Any] = {}
    commit_first = threading.Event()

    def producer(name: str, commit_when: threading.Event | None) -> None:
        with Session(pgtask_engine) as session:
            results[name] = enqueue(session, "t", queue="q", idempotency_key="k")
            if commit_when is not None:
                commit_when.wait(30)
            session.commit()

    with pgtask_engine.connect() as holder:
        # Both producers find the key expired, then queue up to take it over behind this lock.
        holder.execute(text(
            "SELECT 1 FROM pgtask.idempotency_keys WHERE queue = 'q' AND key = 'k' FOR UPDATE"
        ))
        first = threading.Thread(target=producer, args=("first", commit_first))
        first.start()
        wait_until(lambda: waiting_for_a_lock(1), PATIENCE, message="the first producer to wait")
        second = threading.Thread(target=producer, args=("second", None))
        second.start()
        wait_until(lambda: waiting_for_a_lock(2), PATIENCE, message="the second producer to wait")
        holder.rollback()
    # The first takes the key over; the second now waits for the first's commit.
    wait_until(lambda: "first" in results, PATIENCE, message="the first take-over")
    wait_until(lambda: waiting_for_a_lock(1), PATIENCE, message="the second to wait again")
    commit_first.set()
    first.join(30)
    second.join(30)
    assert results["first"].created
    assert results["first"].id != old
    assert results["second"] == (results["first"].id, False)


# -- the single enqueue's statement ---------------------------------------------------------


def test_a_task_with_every_option_default_is_sent_with_four_parameters_and_stores_defaults(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    pgtask_clock.advance(86_400)  # run_at must follow pgtask.now(), not the column default
    sent: list[tuple[str, Any]] = []
    event.listen(
        pgtask_engine, "before_cursor_execute", lambda c, cur, s, p, *a: sent.append((s, p))
    )
    with pgtask_engine.connect() as connection:
        result = enqueue(connection, "plain", {"a": 1})
        database_now = connection.execute(text("SELECT pgtask.now()")).scalar_one()
        connection.commit()
    statement, parameters = sent[0]
    assert statement.startswith("INSERT INTO pgtask.tasks")
    assert sorted(parameters) == ["id", "name", "payload", "queue"]
    with Session(pgtask_engine) as session:
        task = session.get_one(Task, result.id)
    assert (task.queue, task.name, task.version, task.payload, task.headers) == (
        "default", "plain", 1, {"a": 1}, {},
    )
    assert (task.priority, task.max_attempts, task.timeout_seconds) == (0, None, None)
    # Database time a day ahead, within the two statements' distance.
    assert timedelta(0) <= database_now - task.run_at < timedelta(seconds=30)
    assert task.run_at - task.created_at == timedelta(days=1)


def test_options_given_at_their_defaults_still_take_the_four_parameter_form(
    pgtask_engine: Engine,
) -> None:
    sent: list[Any] = []
    event.listen(pgtask_engine, "before_cursor_execute", lambda c, cur, s, p, *a: sent.append(p))
    with pgtask_engine.connect() as connection:
        enqueue(
            connection, "t", None, version=1, priority=0, delay=0, headers={},
            max_attempts=None, timeout=None, idempotency_key=None, run_at=None,
        )
        enqueue(connection, "t", None, delay=timedelta(0))
        connection.commit()
    assert [sorted(p) for p in sent] == [["id", "name", "payload", "queue"]] * 2


@pytest.mark.parametrize(
    "option",
    [{"version": 2}, {"priority": 1}, {"max_attempts": 3}, {"headers": {"h": "v"}},
     {"delay": 60}, {"timeout": 5.0}, {"idempotency_key": "k"},
     {"run_at": datetime(2031, 5, 17, 8, 30, tzinfo=timezone.utc)}],
    ids=lambda option: next(iter(option)),
)
def test_a_task_with_any_option_set_is_sent_with_it(
    pgtask_engine: Engine, option: dict[str, Any]
) -> None:
    sent: list[Any] = []
    event.listen(pgtask_engine, "before_cursor_execute", lambda c, cur, s, p, *a: sent.append(p))
    with Session(pgtask_engine) as session:
        task_id = enqueue(session, "t", None, **option).id
        session.commit()
        task = session.get_one(Task, task_id)
    name = next(iter(option))
    stored = {
        "version": task.version, "priority": task.priority, "max_attempts": task.max_attempts,
        "headers": task.headers, "timeout": task.timeout_seconds,
        "idempotency_key": task.idempotency_key,
        "delay": (task.run_at - task.created_at).total_seconds(), "run_at": task.run_at,
    }[name]
    assert stored == option[name]
    assert len(sent[0]) > 4


def test_the_single_enqueue_keeps_events_echo_and_sqlalchemys_own_text(
    pgtask_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Sent as pre-compiled text, the statement must still reach every observer a compiled
    # one does (cursor events, echo logging) with the text SQLAlchemy itself would send.
    engine = create_engine(pgtask_database_url, echo=True)
    try:
        seen = statements_of(engine)
        contexts: list[Any] = []
        event.listen(
            engine, "before_cursor_execute", lambda c, cur, s, p, ctx, m: contexts.append(ctx)
        )
        with engine.connect() as c:
            plain = {"id": uuid.uuid4(), "queue": "q", "name": "t", "payload": "1"}
            c.execute(ENQUEUE_PLAIN, plain)
            one = {
                **plain, "id": uuid.uuid4(), "version": 1, "headers": "{}", "priority": 5,
                "max_attempts": None, "run_at": None, "delay": 0.0, "timeout_seconds": None,
            }
            c.execute(ENQUEUE_ONE, one)
            c.rollback()
            expected = list(seen)
            seen.clear()
            contexts.clear()
            caplog.clear()
            enqueue(c, "t", {"a": 1})
            enqueue(c, "t", {"a": 1}, priority=5)
            c.commit()
    finally:
        engine.dispose()
    assert len(expected) == 2
    assert seen == expected
    # Sent as text (nothing compiled per execution), yet logged as the construct would be.
    assert [ctx.compiled for ctx in contexts] == [None, None]
    logged = [r.getMessage() for r in caplog.records if r.name == "sqlalchemy.engine.Engine"]
    assert [m for m in logged if m.startswith("INSERT INTO pgtask.tasks")] == expected


def test_before_and_after_execute_listeners_keep_seeing_every_single_enqueue(
    pgtask_engine: Engine,
) -> None:
    executed: list[tuple[str, Any]] = []
    event.listen(
        pgtask_engine, "before_execute", lambda c, clause, *a: executed.append(("before", clause))
    )
    event.listen(
        pgtask_engine, "after_execute", lambda c, clause, *a: executed.append(("after", clause))
    )
    with pgtask_engine.connect() as connection:
        enqueue(connection, "t", {"a": 1})
        enqueue(connection, "t", {"a": 1}, priority=5)
        connection.commit()
    assert executed == [
        ("before", ENQUEUE_PLAIN), ("after", ENQUEUE_PLAIN),
        ("before", ENQUEUE_ONE), ("after", ENQUEUE_ONE),
    ]


def test_a_single_enqueue_on_a_lost_connection_invalidates_it_as_sqlalchemy_would(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.connect() as victim:
        lose(victim)
        with pytest.raises(DBAPIError) as caught:
            enqueue(victim, "t")
        assert caught.value.connection_invalidated
        assert victim.invalidated
    # The pool handed out a fresh connection afterwards.
    with pgtask_engine.connect() as connection:
        enqueue(connection, "t")
        connection.commit()
    assert task_count(pgtask_engine) == 1


def test_a_schema_translate_map_makes_the_single_enqueue_compile_again(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.connect() as connection:
        assert driver_statement(connection, ENQUEUE_PLAIN) is not None
        translated = connection.execution_options(schema_translate_map={None: "public"})
        assert driver_statement(translated, ENQUEUE_PLAIN) is None
        contexts: list[Any] = []
        event.listen(
            translated, "before_cursor_execute", lambda c, cur, s, p, ctx, m: contexts.append(ctx)
        )
        enqueue(translated, "t")
        assert contexts[0].compiled is not None
        connection.commit()
    assert task_count(pgtask_engine) == 1


def test_driver_text_fills_in_literals_and_lists_and_leaves_the_rest_to_sqlalchemy(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.connect() as connection:
        ids = [enqueue(connection, "t").id for _ in range(3)]
        # A literal in the construct (priority=7) compiles to a parameter of its own, and an
        # array parameter given as a tuple must reach psycopg as a list, as SQLAlchemy sends it.
        bump = update(Task).values(priority=7).where(
            Task.id == any_(bindparam("ids", type_=ARRAY(Uuid)))
        )
        prepared = driver_statement(connection, bump)
        assert prepared is not None
        assert list(prepared.literals.values()) == [7]
        assert prepared.arrays == ("ids",)
        assert execute(connection, bump, {"ids": tuple(ids[:2])}).rowcount == 2
        priorities = dict(connection.execute(select(Task.id, Task.priority)).all())
        connection.commit()
        # Parameters SQLAlchemy renames, fills in from a Python-side default or converts
        # (JSON serialised by SQLAlchemy) keep the compiled path.
        assert driver_statement(connection, select(bindparam("a.b", type_=Integer))) is None
        python_default = Table(
            "elsewhere", MetaData(), Column("id", Integer, primary_key=True),
            Column("n", Integer, default=1),
        )
        insert_one = insert(python_default).values(id=bindparam("id", type_=Integer))
        assert driver_statement(connection, insert_one) is None
        assert driver_statement(connection, select(bindparam("doc", type_=JSONB))) is None
    assert priorities == {ids[0]: 7, ids[1]: 7, ids[2]: 0}


def test_repeated_single_enqueues_run_a_prepared_generic_plan_not_a_fresh_one(
    pgtask_engine: Engine,
) -> None:
    # The "no statement that is re-planned each time": psycopg prepares a statement
    # it has run a few times on a connection, and PostgreSQL then settles on a generic plan.
    with pgtask_engine.connect() as connection:
        for i in range(20):
            enqueue(connection, "t", i)
            enqueue(connection, "t", i, priority=1)
            connection.commit()
        prepared = connection.execute(text(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE 'INSERT INTO pgtask.tasks %'"
        )).all()
    # The server sees psycopg's $n placeholders: compare the column lists.
    assert sorted(row.statement.partition(" VALUES")[0] for row in prepared) == sorted(
        str(statement.compile(dialect=pgtask_engine.dialect)).partition(" VALUES")[0]
        for statement in (ENQUEUE_PLAIN, ENQUEUE_ONE)
    )
    for row in prepared:
        # At most PostgreSQL's five trial custom plans; every later execution reused one plan.
        assert row.custom_plans <= 5, row
        assert row.generic_plans >= 5, row
