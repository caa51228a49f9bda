"""Retention keeps a family until it can go as a whole, then deletes it whole, in one statement.

A family is a root and all its descendants. While any member is unfinished or within its own
queue's terminal retention, every member stays: a kept failed or cancelled member can be
retried, and its replay waits for its children's results again. A finished child in a
short-retention queue used to go as soon as its parent was past the parent's own retention,
although the parent was kept (by another child in a long-retention queue) and could still be
retried: the replayed ``wait_for_result`` then found no child.

Old history is made by inserting terminal rows directly, then moving the database clock.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, RetryPolicy, TaskContext, WorkerOptions, configure_queue
from sqlalchemy_pgtask.admin import retry
from sqlalchemy_pgtask.retention import run_retention
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._retention import Retention
from tests.integration.test_retention import DAY, finished, tasks_left
from tests.support.tasks import add, wait_for_state
from tests.support.waiting import PATIENCE, wait_until

YEAR = 365 * DAY


def _left(engine: Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT id FROM pgtask.tasks")).scalars())


def _short_and_long(engine: Engine) -> None:
    with engine.begin() as conn:
        configure_queue(conn, "short", terminal_retention_seconds=0)
        configure_queue(conn, "long", terminal_retention_seconds=int(YEAR))


def test_a_short_lived_child_stays_while_a_sibling_keeps_its_parent(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    _short_and_long(pgtask_engine)
    with pgtask_engine.begin() as conn:
        # The parent is past its own retention, but kept by its long-lived child: it can be
        # retried, and its replay waits for both children again.
        (parent,) = finished(conn, age=DAY, queue="short", state="failed")
        (brief,) = finished(conn, age=DAY, queue="short", parent=parent)
        (lasting,) = finished(conn, age=DAY, queue="long", parent=parent)
    assert run_retention(pgtask_engine).tasks_deleted == 0
    assert _left(pgtask_engine) == {parent, brief, lasting}
    pgtask_clock.advance(YEAR)  # the whole family is past its retention: it goes, leaves first
    result = run_retention(pgtask_engine)
    assert (result.tasks_deleted, tasks_left(pgtask_engine)) == (3, 0)


def test_a_grandchild_stays_while_its_root_is_kept(pgtask_engine: Engine) -> None:
    _short_and_long(pgtask_engine)
    with pgtask_engine.begin() as conn:
        (root,) = finished(conn, age=DAY, queue="long", state="failed")
        # The middle task is past its retention but kept (its root is): it can be retried.
        (middle,) = finished(conn, age=DAY, queue="short", parent=root, state="failed")
        (leaf,) = finished(conn, age=DAY, queue="short", parent=middle)
    assert run_retention(pgtask_engine).tasks_deleted == 0
    assert _left(pgtask_engine) == {root, middle, leaf}


def test_a_run_for_one_queue_deletes_only_the_families_wholly_in_it(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        (mixed,) = finished(conn, age=30 * DAY, queue="a")
        (elsewhere,) = finished(conn, age=30 * DAY, queue="b", parent=mixed)
        (own,) = finished(conn, age=30 * DAY, queue="a")
        (own_child,) = finished(conn, age=30 * DAY, queue="a", parent=own)
    # A family is never split: the one with a member in queue b waits for an unscoped run.
    assert run_retention(pgtask_engine, queue="a").tasks_deleted == 2
    assert _left(pgtask_engine) == {mixed, elsewhere}
    assert run_retention(pgtask_engine, queue="b").tasks_deleted == 0  # b holds no root
    assert run_retention(pgtask_engine).tasks_deleted == 2
    assert own_child not in _left(pgtask_engine)


def test_an_unfinished_member_keeps_its_whole_family(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        (root,) = finished(conn, age=30 * DAY)
        (done,) = finished(conn, age=30 * DAY, parent=root)
        (open_branch,) = finished(conn, age=30 * DAY, parent=root)
        running = conn.execute(text(
            "INSERT INTO pgtask.tasks (queue, name, payload, parent_id)"
            " VALUES ('default', 'job', 'null', :p) RETURNING id"), {"p": open_branch},
        ).scalar_one()
        (stranger,) = finished(conn, age=30 * DAY)  # another family, all past retention
    assert run_retention(pgtask_engine).tasks_deleted == 1
    assert _left(pgtask_engine) == {root, done, open_branch, running}
    assert stranger not in _left(pgtask_engine)


# -- no head-of-line blocking: a row another transaction holds holds up nothing else ----------


def _retention_in_the_background(engine: Engine) -> threading.Thread:
    """`run_retention` in a thread (it may wait for a held lock: the test must not)."""
    thread = threading.Thread(target=run_retention, args=(engine,), daemon=True)
    thread.start()
    return thread


def _held(engine: Engine, sql: str, **params: Any) -> Connection:
    """An open transaction of another connection that ran ``sql`` (a lock it keeps)."""
    holder = engine.connect()
    holder.execute(text(sql), params)
    return holder


@pytest.mark.parametrize("held", ["expired task", "family root", "family sibling"])
def test_a_task_row_held_by_another_transaction_holds_up_no_other_deletion(
    pgtask_engine: Engine, held: str
) -> None:
    with pgtask_engine.begin() as conn:
        others = finished(conn, 20, age=30 * DAY)
        (root,) = finished(conn, age=30 * DAY)
        leaves = finished(conn, 3, age=30 * DAY, parent=root)
    target = {"expired task": others[0], "family root": root, "family sibling": leaves[0]}[held]
    holder = _held(pgtask_engine, "SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE",
                   id=target)
    try:
        runner = _retention_in_the_background(pgtask_engine)
        # A family goes whole: one member held keeps every member for a later run.
        expected_left = {target} if held == "expired task" else {root, *leaves}
        wait_until(lambda: _left(pgtask_engine) == expected_left, PATIENCE,
                   message="every other expired task deleted while the lock is held")
        runner.join(PATIENCE)
        assert not runner.is_alive()
    finally:
        holder.rollback()
        holder.close()
    run_retention(pgtask_engine)  # the lock gone, a later run takes what was passed over
    assert _left(pgtask_engine) == set()


@pytest.mark.parametrize("table", ["checkpoints", "attempts"])
def test_a_history_row_held_by_another_transaction_holds_up_no_other_deletion(
    pgtask_engine: Engine, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Deleting a task deletes its history (a cascade, a trigger), which would wait for a row
    # of it another transaction holds: that task is passed over, the others go.
    with pgtask_engine.begin() as conn:
        others = finished(conn, 20, age=30 * DAY)
        conn.execute(text(
            "INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)"
            " SELECT id, 1, 'charge', 0, 'step', 'true' FROM unnest(CAST(:ids AS uuid[])) AS id"
        ), {"ids": others})
        conn.execute(text(
            "INSERT INTO pgtask.attempts (task_id, attempt, lease_token, state, finished_at)"
            " SELECT id, 1, gen_random_uuid(), 'succeeded', pgtask.now()"
            " FROM unnest(CAST(:ids AS uuid[])) AS id"
        ), {"ids": others})
    target = others[0]
    caplog.set_level(logging.WARNING, "sqlalchemy_pgtask.retention")
    holder = _held(
        pgtask_engine, f"SELECT 1 FROM pgtask.{table} WHERE task_id = :id FOR UPDATE", id=target
    )
    try:
        runner = _retention_in_the_background(pgtask_engine)
        wait_until(lambda: _left(pgtask_engine) == {target}, PATIENCE,
                   message="every other expired task deleted while the lock is held")
        runner.join(PATIENCE)
        assert not runner.is_alive()
    finally:
        holder.rollback()
        holder.close()
    # The batch failed on the held row (lock_timeout), its tasks went one at a time, and the
    # one whose row is held was set aside with its id and the reason.
    [warning] = [r.getMessage() for r in caplog.records if "passed over task" in r.getMessage()]
    assert str(target) in warning
    assert "LockNotAvailable" in warning
    run_retention(pgtask_engine)
    assert _left(pgtask_engine) == set()


async def test_a_worker_pass_sets_aside_a_task_whose_history_row_is_held(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with pgtask_engine.begin() as conn:
        others = finished(conn, 30, age=30 * DAY)
        conn.execute(text(
            "INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)"
            " VALUES (:id, 1, 'charge', 0, 'step', 'true')"), {"id": others[0]})
    caplog.set_level(logging.WARNING, "sqlalchemy_pgtask.retention")
    service = Retention(interval=60.0, batch_size=10)
    # The worker's maintenance connection: autocommit, its lock_timeout.
    autocommit = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    held = HeldConnection(autocommit, lock_timeout=0.5, statement_timeout=60.0)
    holder = _held(pgtask_engine,
                   "SELECT 1 FROM pgtask.checkpoints WHERE task_id = :id FOR UPDATE", id=others[0])
    try:
        async with held.use() as connection:
            assert await service.run_once(connection) is None  # no failed pass
    finally:
        holder.rollback()
        holder.close()
        await held.close()
    assert _left(pgtask_engine) == {others[0]}
    assert any(str(others[0]) in r.getMessage() for r in caplog.records)


# -- the reproduction with a real worker and durable workflow -----------------------------------


async def test_a_retried_workflow_finds_its_short_lived_child_after_retention(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, pgtask_database_url: str
) -> None:
    _short_and_long(pgtask_engine)
    registry = Registry()

    @registry.task("brief", queue="short")
    async def brief(ctx: TaskContext, payload: None) -> str:
        return "brief"

    @registry.task("lasting", queue="long")
    async def lasting(ctx: TaskContext, payload: None) -> str:
        return "lasting"

    failed_once: list[bool] = []

    @registry.task("parent", queue="short", retry=RetryPolicy.never())
    async def parent(ctx: TaskContext, payload: None) -> list[Any]:
        first = await ctx.spawn("brief", "brief", None, queue="short")
        second = await ctx.spawn("lasting", "lasting", None, queue="long")
        kept = (await ctx.wait_for_result("l", second)).result
        # Fails the first time here, before it asked for the brief child's result. Not by
        # ctx.attempt: a parent that waited for its child resumes in a new attempt, so the
        # first run got here as attempt 1 or 2 depending on which finished first.
        if not failed_once:
            failed_once.append(True)
            raise RuntimeError("fails once its long-lived child is done")
        return [(await ctx.wait_for_result("b", first)).result, kept]

    options = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.2,
                            queues=("short", "long"))
    task_id = await add(pgtask_async_engine, "parent", queue="short")
    async with running_worker(registry, pgtask_database_url, options):
        assert (await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE))[
            "state"] == "failed"
        with pgtask_engine.connect() as conn:
            children = conn.execute(text(
                "SELECT id FROM pgtask.tasks WHERE parent_id = :p"), {"p": task_id}).scalars()
            for child in list(children):
                await wait_for_state(pgtask_async_engine, child, timeout=PATIENCE)
        # The parent is past its own retention (0 s) but kept by its long-lived child; the
        # brief child went here before, and the retried parent's replay failed on it ("not a
        # direct child").
        run_retention(pgtask_engine)
        with pgtask_engine.begin() as conn:
            retry(conn, task_id)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["error"], row["result"]) == (
        "succeeded", None, ["brief", "lasting"])
    assert len(_left(pgtask_engine)) == 3


# -- a deep chain goes whole, in one walk ----------------------------------------------------


def chain(conn: Connection, depth: int, *, age: float) -> uuid.UUID:
    """Insert a chain of ``depth`` terminal tasks (each the parent of the next), finished
    ``age`` seconds ago; returns the root."""
    return uuid.UUID(str(conn.execute(text(
        "WITH RECURSIVE ids(n, id, parent_id) AS ("
        "  SELECT 1, gen_random_uuid(), NULL::uuid"
        "  UNION ALL SELECT n + 1, gen_random_uuid(), id FROM ids WHERE n < :depth),"
        " ins AS (INSERT INTO pgtask.tasks (id, queue, name, payload, state, attempt,"
        "  max_attempts, completed_at, parent_id, has_children)"
        "  SELECT id, 'default', 'job', 'null', 'succeeded', 1, 1,"
        "   pgtask.now() - make_interval(secs => :age), parent_id, n < :depth FROM ids)"
        " SELECT id FROM ids WHERE n = 1"), {"depth": depth, "age": age}).scalar_one()))


def test_a_deep_expired_chain_goes_in_one_batch(pgtask_engine: Engine) -> None:
    # Only a leaf could go, one per batch, each batch walking the chain left: quadratic (a
    # 2,000-deep chain took 2,002 batches). Now the family goes whole in one DELETE.
    with pgtask_engine.begin() as conn:
        chain(conn, 3000, age=30 * DAY)
        finished(conn, 5, age=30 * DAY)  # and five families of one
    deletes: list[str] = []

    def count_deletes(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "DELETE FROM pgtask.tasks WHERE" in statement:
            deletes.append(statement)

    event.listen(pgtask_engine, "before_cursor_execute", count_deletes)
    try:
        result = run_retention(pgtask_engine, batch_size=1000)
    finally:
        event.remove(pgtask_engine, "before_cursor_execute", count_deletes)
    assert (result.tasks_deleted, tasks_left(pgtask_engine)) == (3005, 0)
    # The batch with the chain (3,005 rows: never split), then one that finds none left.
    assert len(deletes) == 2
