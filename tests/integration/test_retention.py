"""Retention: finished history and idempotency reservations go per queue, in bounded batches,
a workflow family whole; an unexpired key is never released; claims are never held up.

Old history is made by inserting terminal rows directly (``completed_at`` in the database's
past) or by moving the database clock (``pgtask_clock``), never by waiting.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    InvalidNameError,
    InvalidOptionError,
    QueueFull,
    Registry,
    TaskContext,
    WorkerOptions,
    configure_queue,
    enqueue,
    list_queues,
)
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.retention import RetentionResult, run_retention, run_retention_async
from sqlalchemy_pgtask.statements import retention as st_retention
from sqlalchemy_pgtask.testing import DatabaseClock, drain
from sqlalchemy_pgtask.worker._maintenance import MAX_BATCHES_PER_PASS
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._retention import Retention
from tests.support.durable import claim, claim_one, complete, emit, save_checkpoint
from tests.support.engines import statements_of
from tests.support.tasks import claim_parameters

DAY = 24 * 3600.0
WEEK = 7 * DAY


def finished(
    conn: Connection,
    count: int = 1,
    *,
    age: float,
    queue: str = "default",
    parent: uuid.UUID | None = None,
    key: str | None = None,
    state: str = "succeeded",
) -> list[uuid.UUID]:
    """Insert ``count`` terminal tasks that finished ``age`` seconds ago (database time);
    with ``key``, each reserves ``key`` (suffixed by its number when ``count`` > 1)."""
    rows = conn.execute(
        text(
            "INSERT INTO pgtask.tasks (queue, name, payload, state, attempt, max_attempts,"
            " completed_at, parent_id, has_children, idempotency_key)"
            " SELECT :queue, 'job', 'null', :state, 1, 1,"
            "  pgtask.now() - make_interval(secs => :age) - make_interval(secs => i * 0.001),"
            "  :parent, false,"
            "  CASE WHEN CAST(:key AS text) IS NULL THEN NULL"
            "       WHEN :count = 1 THEN CAST(:key AS text) ELSE CAST(:key AS text) || '-' || i END"
            " FROM generate_series(1, :count) AS i ORDER BY i RETURNING id, idempotency_key"
        ),
        {"queue": queue, "state": state, "age": age, "parent": parent, "key": key,
         "count": count},
    ).all()
    if key is not None:
        conn.execute(
            text("INSERT INTO pgtask.idempotency_keys (queue, key, task_id)"
                 " SELECT :queue, unnest(CAST(:keys AS text[])), unnest(CAST(:ids AS uuid[]))"),
            {"queue": queue, "keys": [r.idempotency_key for r in rows],
             "ids": [r.id for r in rows]},
        )
    if parent is not None:
        conn.execute(text("UPDATE pgtask.tasks SET has_children = true WHERE id = :p"),
                     {"p": parent})
    return [r.id for r in rows]


def count(conn: Connection, sql: str, **params: Any) -> int:
    return int(conn.execute(text(f"SELECT count(*) FROM {sql}"), params).scalar_one())


def tasks_left(engine: Engine, queue: str | None = None) -> int:
    with engine.connect() as conn:
        if queue is None:
            return count(conn, "pgtask.tasks")
        return count(conn, "pgtask.tasks WHERE queue = :q", q=queue)


def keys_left(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT key FROM pgtask.idempotency_keys")).scalars())


# -- ordering ----------------------------------------------------------------------------------


def tree(conn: Connection) -> dict[uuid.UUID, uuid.UUID | None]:
    """A root, two children, four grandchildren; the root finished first (oldest), so
    oldest-first alone would take it first. Returns each task's parent."""
    (root,) = finished(conn, age=30 * DAY)
    parents: dict[uuid.UUID, uuid.UUID | None] = {root: None}
    for _ in range(2):
        (child,) = finished(conn, age=29 * DAY, parent=root)
        parents[child] = root
        for grandchild in finished(conn, 2, age=28 * DAY, parent=child):
            parents[grandchild] = child
    return parents


def test_a_family_is_never_split_by_the_batch_size(pgtask_engine: Engine) -> None:
    # Deleting a parent without its child would set the child's parent_id to NULL: a family
    # larger than the batch goes whole in one batch, its links intact until it does.
    with pgtask_engine.begin() as conn:
        parents = tree(conn)
        others = finished(conn, 3, age=31 * DAY)  # older roots: taken first
    result = run_retention(pgtask_engine, batch_size=2, max_batches=1)
    assert (result.tasks_deleted, tasks_left(pgtask_engine)) == (2, 8)
    with pgtask_engine.connect() as conn:
        rows = conn.execute(text("SELECT id, parent_id FROM pgtask.tasks")).all()
    assert {r.id for r in rows} == set(parents) | {others[0]}  # ages: i ms apart, the last
    assert all(r.parent_id == parents.get(r.id) for r in rows)  # youngest of the three
    result = run_retention(pgtask_engine, batch_size=2, max_batches=1)
    # The lone root reaches the limit of 2 with the family of 7 after it: one batch of 8.
    assert (result.tasks_deleted, tasks_left(pgtask_engine)) == (8, 0)


def test_one_batch_deletes_a_whole_tree(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        parents = tree(conn)
    with pgtask_engine.begin() as conn:  # one statement: the parent_id links never set NULL
        rows = conn.execute(st_retention.DELETE_FINISHED_TASKS, {"queue": None, "limit": 1000})
        assert {r.id for r in rows} == set(parents)
    assert tasks_left(pgtask_engine) == 0


def test_a_parent_stays_while_a_child_is_unfinished_or_kept(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        (root,) = finished(conn, age=30 * DAY)
        enqueue(conn, "job")  # unrelated pending work
        conn.execute(
            text("INSERT INTO pgtask.tasks (queue, name, payload, parent_id)"
                 " VALUES ('default', 'job', 'null', :p)"), {"p": root},
        )
        configure_queue(conn, "kept", terminal_retention_seconds=int(365 * DAY))
        (other_root,) = finished(conn, age=30 * DAY)
        finished(conn, age=30 * DAY, queue="kept", parent=other_root)
    assert run_retention(pgtask_engine).tasks_deleted == 0
    assert tasks_left(pgtask_engine) == 5


def test_a_finished_child_stays_while_its_parent_is_kept(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    # A failed parent may be retried for as long as it is kept, and its replay waits for its
    # children again: a child kept more briefly by its own queue used to go first, and the
    # retried workflow failed ("not a direct child").
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "children", terminal_retention_seconds=0)
        (parent,) = finished(conn, age=3 * DAY, state="failed")
        finished(conn, age=3 * DAY + 60, queue="children", parent=parent)
    assert run_retention(pgtask_engine).tasks_deleted == 0
    pgtask_clock.advance(4 * DAY + 60)  # the parent's week is up: the tree goes, leaves first
    result = run_retention(pgtask_engine)
    assert (result.tasks_deleted, tasks_left(pgtask_engine)) == (2, 0)


# -- idempotency keys --------------------------------------------------------------------------


def test_an_unexpired_key_is_never_released_when_its_task_is_deleted(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "q", terminal_retention_seconds=60,
                        idempotency_retention_seconds=3600)
        first = enqueue(conn, "job", queue="q", idempotency_key="order-1")
        conn.execute(text("UPDATE pgtask.tasks SET state = 'succeeded',"
                          " completed_at = pgtask.now() WHERE id = :id"), {"id": first.id})
    pgtask_clock.advance(120)
    result = run_retention(pgtask_engine)
    assert (result.tasks_deleted, result.keys_deleted) == (1, 0)
    assert tasks_left(pgtask_engine) == 0
    with pgtask_engine.begin() as conn:
        again = enqueue(conn, "job", queue="q", idempotency_key="order-1")
    assert (again.id, again.created) == (first.id, False)

    pgtask_clock.advance(3600 - 120 - 5)  # 5 s before the key expires
    assert run_retention(pgtask_engine).keys_deleted == 0
    with pgtask_engine.begin() as conn:
        assert enqueue(conn, "job", queue="q", idempotency_key="order-1").id == first.id

    pgtask_clock.advance(10)
    assert run_retention(pgtask_engine).keys_deleted == 1
    with pgtask_engine.begin() as conn:
        fresh = enqueue(conn, "job", queue="q", idempotency_key="order-1")
    assert fresh.created
    assert fresh.id != first.id


def test_a_key_of_a_task_finished_long_ago_goes_while_the_task_stays(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "q", terminal_retention_seconds=int(WEEK),
                        idempotency_retention_seconds=60)
        (old,) = finished(conn, age=120, queue="q", key="old")
        (recent,) = finished(conn, age=30, queue="q", key="recent")
        pending = enqueue(conn, "job", queue="q", idempotency_key="pending")
        running = enqueue(conn, "job", queue="q", idempotency_key="running")
    with pgtask_engine.begin() as conn:
        params = claim_parameters(worker_id=uuid.uuid4(), lease=30.0, queue="q", limit=1)
        assert len(conn.execute(st.CLAIM, params).all()) == 1  # one of the two runs now
    result = run_retention(pgtask_engine)
    assert (result.tasks_deleted, result.keys_deleted) == (0, 1)
    assert keys_left(pgtask_engine) == {"recent", "pending", "running"}
    assert tasks_left(pgtask_engine) == 4  # the task itself is kept a week
    with pgtask_engine.begin() as conn:
        reused = enqueue(conn, "job", queue="q", idempotency_key="old")
        assert reused.created
        assert reused.id != old
        assert enqueue(conn, "job", queue="q", idempotency_key="recent").id == recent
        assert enqueue(conn, "job", queue="q", idempotency_key="pending").id == pending.id
        assert enqueue(conn, "job", queue="q", idempotency_key="running").id == running.id
    # Deleting the old task later leaves the key's new reservation alone.
    pgtask_clock.advance(WEEK)
    assert run_retention(pgtask_engine, queue="q").tasks_deleted == 2
    with pgtask_engine.begin() as conn:
        assert enqueue(conn, "job", queue="q", idempotency_key="old").id == reused.id


def test_the_key_of_a_task_being_retried_is_kept(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "q", idempotency_retention_seconds=60)
        (task,) = finished(conn, age=120, queue="q", key="k", state="failed")
    with pgtask_engine.connect() as admin:
        # An administrative retry, not committed yet: the task row is locked, still failed
        # in every other transaction's snapshot.
        admin.execute(text("UPDATE pgtask.tasks SET state = 'pending', completed_at = NULL,"
                           " run_at = pgtask.now() WHERE id = :id"), {"id": task})
        assert run_retention(pgtask_engine, queue="q").keys_deleted == 0
        admin.commit()
    assert run_retention(pgtask_engine, queue="q").keys_deleted == 0  # live again
    with pgtask_engine.begin() as conn:
        again = enqueue(conn, "job", queue="q", idempotency_key="k")
    assert (again.id, again.created) == (task, False)


def test_a_batch_passes_over_a_task_whose_key_a_producer_is_taking_over(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    # Deleting a keyed task writes its reservation's expiry down. That write used to wait for
    # a producer holding the reservation (taking the expired key over, not committed yet): the
    # batch hung as long as the producer's transaction, every producer of a key the batch had
    # already touched waited behind it, and one re-using such a key deadlocked with it.
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "q", terminal_retention_seconds=0, idempotency_retention_seconds=0)
        finished(conn, age=10, queue="q", key="k2")
        (held,) = finished(conn, age=5, queue="q", key="k1")
    # A lock wait fails within 2 s instead of hanging the test.
    impatient = create_engine(pgtask_database_url, connect_args={"options": "-c lock_timeout=2s"})
    try:
        with pgtask_engine.connect() as producer:
            producer.begin()
            taken = enqueue(producer, "job", queue="q", idempotency_key="k1")
            assert taken.created  # k1 had expired
            result = run_retention(impatient, queue="q")
            assert (result.tasks_deleted, result.keys_deleted) == (1, 1)  # k2's task and key
            with impatient.begin() as other:  # the batch is over: nobody waits for it
                assert enqueue(other, "job", queue="q", idempotency_key="k2").created
                assert count(other, "pgtask.tasks WHERE id = :id", id=held) == 1
            producer.commit()
        # k1 is the producer's task's now: the old task goes, the reservation stays.
        result = run_retention(impatient, queue="q")
        assert (result.tasks_deleted, result.keys_deleted) == (1, 0)
        with impatient.begin() as other:
            again = enqueue(other, "job", queue="q", idempotency_key="k1")
        assert (again.id, again.created) == (taken.id, False)
    finally:
        impatient.dispose()


def test_a_batch_locks_no_reservation_of_a_task_it_keeps(pgtask_engine: Engine) -> None:
    # The reservation lock ran on every candidate of the index range, before the child and
    # parent checks: a batch that deleted nothing still locked (and rewrote) the keys of all
    # the tasks it kept, and producers re-using those keys waited for it.
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "children", terminal_retention_seconds=0)
        (parent,) = finished(conn, age=DAY, state="failed")  # kept a week
        finished(conn, 3, age=60, queue="children", parent=parent, key="kept")
    with pgtask_engine.connect() as retention, pgtask_engine.connect() as producer:
        retention.begin()
        assert retention.execute(
            st_retention.DELETE_FINISHED_TASKS, {"queue": None, "limit": 1000}
        ).all() == []
        producer.execute(text("SET lock_timeout = '100ms'"))
        locked = producer.execute(text(
            "SELECT key FROM pgtask.idempotency_keys WHERE queue = 'children'"
            " ORDER BY key FOR NO KEY UPDATE"
        )).scalars().all()
        assert locked == ["kept-1", "kept-2", "kept-3"]
        producer.rollback()
        retention.rollback()


def test_finished_key_windows_read_every_task_once_ties_included(pgtask_engine: Engine) -> None:
    # 25 tasks sharing one completion time, then 5 more: windows of 10 end on a tie group.
    with pgtask_engine.begin() as conn:
        ids = finished(conn, 25, age=3 * DAY, key="tie")
        conn.execute(text("UPDATE pgtask.tasks SET completed_at = pgtask.now() - interval '3 days'"
                          " WHERE id = ANY(:ids)"), {"ids": ids})
        finished(conn, 5, age=2 * DAY, key="later")
        configure_queue(conn, "default", idempotency_retention_seconds=int(DAY))
    result = run_retention(pgtask_engine, batch_size=10)
    assert (result.tasks_deleted, result.keys_deleted) == (0, 30)
    assert keys_left(pgtask_engine) == set()


# -- per-queue settings, bounds ------------------------------------------------------------------


def test_each_queue_keeps_its_history_as_long_as_it_says(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "short", terminal_retention_seconds=60)
        configure_queue(conn, "long", terminal_retention_seconds=int(30 * DAY))
        finished(conn, 2, age=120, queue="short")
        finished(conn, 2, age=120, queue="long")
        finished(conn, 2, age=120, queue="unset")  # no row: 7 days
        finished(conn, 1, age=30, queue="short")
    assert run_retention(pgtask_engine).tasks_deleted == 2
    assert (tasks_left(pgtask_engine, "short"), tasks_left(pgtask_engine, "unset")) == (1, 2)
    pgtask_clock.advance(WEEK)
    assert run_retention(pgtask_engine, queue="long").tasks_deleted == 0
    assert run_retention(pgtask_engine, queue="unset").tasks_deleted == 2
    assert tasks_left(pgtask_engine, "short") == 1  # a run for another queue left it
    assert run_retention(pgtask_engine).tasks_deleted == 1
    pgtask_clock.advance(30 * DAY)
    assert run_retention(pgtask_engine).tasks_deleted == 2
    assert tasks_left(pgtask_engine) == 0


def test_a_zero_retention_deletes_as_soon_as_finished(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "now", terminal_retention_seconds=0,
                        idempotency_retention_seconds=0)
        finished(conn, 3, age=0, queue="now", key="k")
    result = run_retention(pgtask_engine)
    assert (result.tasks_deleted, result.keys_deleted) == (3, 3)


def test_a_batch_deletes_at_most_batch_size_rows(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        finished(conn, 25, age=30 * DAY)
        finished(conn, 3, age=30 * DAY, queue="other")
    with pgtask_engine.begin() as conn:
        rows = conn.execute(st_retention.DELETE_FINISHED_TASKS, {"queue": None, "limit": 10}).all()
        assert len(rows) == 10
        oldest = conn.execute(text(
            "SELECT count(*) FROM pgtask.tasks WHERE queue = 'default'")).scalar_one()
        assert oldest == 15
        conn.rollback()
    one = run_retention(pgtask_engine, batch_size=10, max_batches=1)
    assert (one.tasks_deleted, tasks_left(pgtask_engine), one.stopped_early) == (10, 18, True)
    rest = run_retention(pgtask_engine, batch_size=10)
    assert (rest.tasks_deleted, rest.stopped_early) == (18, False)
    assert tasks_left(pgtask_engine) == 0


def test_the_oldest_go_first(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        young = finished(conn, 5, age=10 * DAY)
        old = finished(conn, 5, age=20 * DAY)
    with pgtask_engine.begin() as conn:
        rows = conn.execute(st_retention.DELETE_FINISHED_TASKS, {"queue": None, "limit": 5}).all()
    assert {r.id for r in rows} == set(old)
    assert tasks_left(pgtask_engine) == len(young)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"batch_size": 0}, InvalidOptionError),
        ({"batch_size": True}, InvalidOptionError),
        ({"batch_size": 100_001}, InvalidOptionError),
        ({"max_batches": 0}, InvalidOptionError),
        ({"worker_retention": -1}, InvalidOptionError),
        ({"worker_retention": float("nan")}, InvalidOptionError),
        ({"queue": "no spaces"}, InvalidNameError),
        ({"queue": ""}, InvalidNameError),
    ],
)
def test_bad_options_are_refused_before_any_sql(
    options: dict[str, Any], error: type[Exception]
) -> None:
    engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")  # never connected
    with pytest.raises(error):
        run_retention(engine, **options)


def test_the_engine_is_required(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as conn, pytest.raises(TypeError, match="Engine"):
        run_retention(conn)  # type: ignore[arg-type]


async def test_the_async_twin_deletes_the_same(pgtask_async_engine: AsyncEngine,
                                               pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        finished(conn, 12, age=30 * DAY, key="k")
    result = await run_retention_async(pgtask_async_engine, batch_size=5)
    assert result == RetentionResult(tasks_deleted=12, keys_deleted=12, workers_deleted=0,
                                     batches=result.batches)
    assert tasks_left(pgtask_engine) == 0
    assert keys_left(pgtask_engine) == set()


# -- what deleting a task takes with it ------------------------------------------------------


def test_a_deleted_task_takes_its_attempts_steps_signals_and_waits(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with pgtask_engine.begin() as conn:
        fks = conn.execute(text(
            "SELECT conrelid::regclass::text, confdeltype FROM pg_constraint"
            " WHERE contype = 'f' AND confrelid = 'pgtask.tasks'::regclass"
        )).all()
    # Attempts have no foreign key (its check locked each claimed task): a trigger deletes them.
    assert dict(fks) == {
        "pgtask.checkpoints": "c", "pgtask.signals": "c",
        "pgtask.waits": "c", "pgtask.tasks": "n",  # parent_id: SET NULL (never reached)
    }
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        task = enqueue(conn, "job").id
        lease = claim_one(conn)
        save_checkpoint(conn, lease, "charge", {"ok": True})
        emit(conn, task, "approved", True)
        complete(conn, lease, "done")
        conn.execute(text(
            "INSERT INTO pgtask.waits (task_id, kind, version, step, occurrence, signal_name,"
            " signal_occurrence) VALUES (:t, 'signal', 1, 's', 0, 'never', 0)"), {"t": task})
        keep = enqueue(conn, "job").id
        claim_one(conn)  # an unfinished task's attempt stays
    pgtask_clock.advance(WEEK + 60)
    assert run_retention(pgtask_engine).tasks_deleted == 1
    with pgtask_engine.connect() as conn:
        for table in ("attempts", "checkpoints", "signals", "waits"):
            assert count(conn, f"pgtask.{table} WHERE task_id = :t", t=task) == 0, table
        assert count(conn, "pgtask.attempts WHERE task_id = :t", t=keep) == 1


def test_the_capacity_counter_is_right_after_retention(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "default", max_outstanding_tasks=5)
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(4):
            enqueue(conn, "job")
        complete(conn, claim_one(conn))
        complete(conn, claim_one(conn))
        finished(conn, 20, age=30 * DAY)
        claim_one(conn)  # one running, one pending, two succeeded just now
    pgtask_clock.advance(WEEK + 60)
    assert run_retention(pgtask_engine).tasks_deleted == 22
    with pgtask_engine.connect() as conn:
        (settings,) = list_queues(conn)
        actual = count(conn, "pgtask.tasks WHERE state IN ('pending', 'running', 'waiting')")
        assert settings.outstanding_tasks == actual == 2
        for _ in range(3):
            enqueue(conn, "job")
        with pytest.raises(QueueFull):
            enqueue(conn, "job")
        conn.rollback()


def test_expired_worker_rows_are_pruned(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        for expired_ago in (7200, 600, -30):
            conn.execute(text(
                "INSERT INTO pgtask.workers (id, queues, version, hostname, pid, concurrency,"
                " expires_at) VALUES (gen_random_uuid(), '{default}', '1', 'h', 1, 1,"
                " pgtask.now() - make_interval(secs => :ago))"), {"ago": expired_ago})
    assert run_retention(pgtask_engine, queue="default").workers_deleted == 0
    assert run_retention(pgtask_engine).workers_deleted == 1
    assert run_retention(pgtask_engine, worker_retention=60).workers_deleted == 1
    with pgtask_engine.connect() as conn:
        assert count(conn, "pgtask.workers") == 1  # the live one


# -- concurrency ---------------------------------------------------------------------------------


def test_concurrent_runs_delete_every_expired_row_exactly_once(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "short-keys", idempotency_retention_seconds=60)
        finished(conn, 1500, age=30 * DAY, key="a")  # tasks and (then expired) keys go
        finished(conn, 600, age=3 * DAY, queue="short-keys", key="b")  # only the keys go
        finished(conn, 300, age=DAY, key="young")  # nothing goes
        conn.execute(text(
            "INSERT INTO pgtask.idempotency_keys (queue, key, task_id, expires_at)"
            " SELECT 'gone', 'x' || i, gen_random_uuid(), pgtask.now() - interval '1 s'"
            " FROM generate_series(1, 400) AS i"))
        conn.execute(text(
            "INSERT INTO pgtask.idempotency_keys (queue, key, task_id, expires_at)"
            " SELECT 'gone', 'y' || i, gen_random_uuid(), pgtask.now() + interval '1 day'"
            " FROM generate_series(1, 100) AS i"))
    results: list[RetentionResult] = []
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run() -> None:
        engine = create_engine(pgtask_database_url)
        try:
            start.wait()
            results.append(run_retention(engine, batch_size=50))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # 1,500 old tasks; their keys (expiry written down as completion + 30 days: just past),
    # 600 keys of tasks finished longer ago than their queue's 60 s, 400 expired reservations.
    assert sum(r.tasks_deleted for r in results) == 1500
    assert sum(r.keys_deleted for r in results) == 1500 + 600 + 400
    assert tasks_left(pgtask_engine) == 900
    left = keys_left(pgtask_engine)
    assert left == {f"young-{i}" for i in range(1, 301)} | {f"y{i}" for i in range(1, 101)}


# -- claims --------------------------------------------------------------------------------------


def _hold_one_batch_of_each(conn: Connection) -> Sequence[int]:
    """Run one batch of each deletion in ``conn``'s transaction, not committed."""
    tasks = conn.execute(st_retention.DELETE_FINISHED_TASKS, {"queue": None, "limit": 1000}).all()
    expired = conn.execute(st_retention.DELETE_EXPIRED_KEYS, {"queue": None, "limit": 1000}).all()
    (window,) = conn.execute(
        st_retention.DELETE_FINISHED_KEYS, {"queue": "default", "after": None, "scan_limit": 1000}
    ).all()
    return len(tasks), len(expired), window.deleted


def test_claims_and_enqueues_never_wait_for_a_retention_batch_held_open(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "default", idempotency_retention_seconds=int(DAY),
                        max_outstanding_tasks=100)
        (parent,) = finished(conn, age=30 * DAY, key="parent")
        finished(conn, 200, age=30 * DAY, key="old")
        finished(conn, 50, age=3 * DAY, key="kept-task")
        conn.execute(text("INSERT INTO pgtask.tasks (queue, name, payload, parent_id)"
                          " VALUES ('default', 'job', 'null', :p)"), {"p": parent})
        enqueue(conn, "job", idempotency_key="live")
    with pgtask_engine.connect() as retention, pgtask_engine.connect() as worker:
        retention.begin()
        # Its own deletions wrote the keys' expiry down: the same transaction deletes them.
        assert _hold_one_batch_of_each(retention) == (200, 200, 51)
        with worker.begin():
            worker.execute(text("SET lock_timeout = '1s'"))
        # The held transaction locks 200 finished tasks and 251 keys; none is in the way.
        with worker.begin():
            leases = claim(worker, limit=10)
            assert len(leases) == 2  # the child of the held parent, and the keyed task
            for lease in leases:
                complete(worker, lease, "ok")
        with worker.begin():
            again = enqueue(worker, "job", idempotency_key="live")
            fresh = enqueue(worker, "job", idempotency_key="new")
            assert (again.created, fresh.created) == (False, True)
            (lease,) = claim(worker, limit=10)
            complete(worker, lease, "ok")
        retention.rollback()  # a failed pass: everything it held is back, nothing deleted
    assert tasks_left(pgtask_engine) == 254


# -- the worker's service ------------------------------------------------------------------------


async def test_the_worker_service_works_off_a_backlog_pass_by_pass(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    with pgtask_engine.begin() as conn:
        configure_queue(conn, "default", idempotency_retention_seconds=60)
        finished(conn, 200, age=30 * DAY, key="old")
        finished(conn, 30, age=DAY, key="kept-task")  # tasks stay, keys go
        conn.execute(text(
            "INSERT INTO pgtask.workers (id, queues, version, hostname, pid, concurrency,"
            " expires_at) VALUES (gen_random_uuid(), '{default}', '1', 'h', 1, 1,"
            " pgtask.now() - interval '1 day')"))
    service = Retention(interval=60.0, batch_size=10)
    assert (service.name, service.interval) == ("retention", 60.0)
    # The worker's maintenance connection: autocommit, timeouts, its planner settings.
    autocommit = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    held = HeldConnection(autocommit, lock_timeout=2.0, statement_timeout=60.0)
    try:
        async with held.use() as connection:
            # At most MAX_BATCHES_PER_PASS batches of each kind, then a prompt next pass.
            assert await service.run_once(connection) == pytest.approx(0.1)
            assert tasks_left(pgtask_engine) == 230 - MAX_BATCHES_PER_PASS * 10
            assert await service.run_once(connection) is None
            assert await service.run_once(connection) is None
    finally:
        await held.close()
    assert tasks_left(pgtask_engine) == 30
    assert keys_left(pgtask_engine) == set()
    with pgtask_engine.connect() as conn:
        assert count(conn, "pgtask.workers") == 1  # worker rows are WorkerPruning's


async def test_a_worker_pass_reads_only_queues_with_keys_due_and_reaches_every_one(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    # Every queue with finished tasks used to cost a finished-keys batch, due or not: with
    # more such queues than a pass's batches, every pass stopped at its limit and asked for
    # the next 0.1 s later, for ever, and the queues after the sixteenth by name were never
    # read (their expired keys stayed).
    queues = MAX_BATCHES_PER_PASS + 4
    with pgtask_engine.begin() as conn:
        for i in range(queues):
            finished(conn, age=60, queue=f"quiet-{i:02d}", key="recent")  # kept 30 days
    service = Retention(interval=60.0, batch_size=10)
    autocommit = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    held = HeldConnection(autocommit, lock_timeout=2.0, statement_timeout=60.0)
    try:
        async with held.use() as connection:
            sent = statements_of(pgtask_async_engine.sync_engine)
            assert await service.run_once(connection) is None
            # Finished tasks, expired keys, the queues with keys due: none has any.
            assert len(sent) == 3
            with pgtask_engine.begin() as conn:
                for i in range(queues):
                    configure_queue(conn, f"short-{i:02d}", idempotency_retention_seconds=60)
                    finished(conn, age=DAY, queue=f"short-{i:02d}", key="expired")
            assert await service.run_once(connection) == pytest.approx(0.1)
            with pgtask_engine.connect() as conn:
                assert count(conn, "pgtask.idempotency_keys WHERE queue LIKE 'short-%'") == 4
            # The queues not reached go first in the next pass, which finishes them.
            assert await service.run_once(connection) is None
    finally:
        await held.close()
    with pgtask_engine.connect() as conn:
        assert count(conn, "pgtask.idempotency_keys WHERE queue LIKE 'short-%'") == 0
        assert count(conn, "pgtask.idempotency_keys WHERE queue LIKE 'quiet-%'") == queues
    assert tasks_left(pgtask_engine) == 2 * queues


async def test_a_worker_drains_while_a_retention_batch_is_held_open(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    registry = Registry()

    @registry.task("job")
    async def job(ctx: TaskContext, payload: Any) -> str:
        return "ran"

    with pgtask_engine.begin() as conn:
        configure_queue(conn, "default", max_outstanding_tasks=50)
        (parent,) = finished(conn, age=30 * DAY, key="parent")
        finished(conn, 300, age=30 * DAY, key="old")
        conn.execute(text("INSERT INTO pgtask.tasks (queue, name, payload, parent_id)"
                          " VALUES ('default', 'job', 'null', :p)"), {"p": parent})
        for i in range(20):
            enqueue(conn, "job", idempotency_key=f"new-{i}")
    with pgtask_engine.connect() as retention:
        retention.begin()
        assert _hold_one_batch_of_each(retention)[0] == 300
        # The worker's statements wait at most lock_timeout (a quarter of the lease): a
        # claim or completion held up by retention would fail the drain.
        await drain(registry, pgtask_database_url, WorkerOptions(lease_duration=2.0),
                    timeout=30)
        retention.rollback()
    with pgtask_engine.connect() as conn:
        assert count(conn, "pgtask.tasks WHERE name = 'job' AND state = 'succeeded'"
                     " AND result = '\"ran\"'") == 21
