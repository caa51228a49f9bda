"""One kind of retention cut short stops no other kind, and a set-aside root rests across passes.

A pass (a worker's, or a ``run_retention`` run) deletes finished tasks, then expired
reservations, reservations of tasks finished long ago and worker rows. A statement of one kind
cut short by another transaction or a timeout (the listing of the fallback's candidates
included) used to fail the whole pass, every pass, so the later kinds were never reached; and a
root whose history row another transaction holds was tried again (a failed batch, its single
delete and a warning) on every worker pass. Real faults: a lock held on another connection,
with a short ``lock_timeout``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask.cli._retention import result_line
from sqlalchemy_pgtask.retention import run_retention
from sqlalchemy_pgtask.worker._reconnect import HeldConnection
from sqlalchemy_pgtask.worker._retention import Retention
from tests.integration.test_retention import DAY, count, finished, keys_left, tasks_left


@pytest.fixture
def impatient_engine(pgtask_database_url: str) -> Iterator[Engine]:
    """An engine whose statements give up on a lock after 200 ms (as a worker's do)."""
    engine = create_engine(pgtask_database_url,
                           connect_args={"options": "-c lock_timeout=200"})
    try:
        yield engine
    finally:
        engine.dispose()


def _expired_key_and_worker(conn: Connection) -> None:
    conn.execute(text(
        "INSERT INTO pgtask.idempotency_keys (queue, key, task_id, expires_at)"
        " VALUES ('gone', 'expired', gen_random_uuid(), pgtask.now() - interval '1 s')"))
    conn.execute(text(
        "INSERT INTO pgtask.workers (id, queues, version, hostname, pid, concurrency,"
        " expires_at) VALUES (gen_random_uuid(), '{default}', '1', 'h', 1, 1,"
        " pgtask.now() - interval '2 days')"))


def _tasks_locked(engine: Engine) -> Connection:
    """Another connection's open transaction holding the tasks table (a migration, say):
    every statement that reads finished tasks, the fallback's listing too, waits for it."""
    holder = engine.connect()
    holder.execute(text("LOCK TABLE pgtask.tasks IN ACCESS EXCLUSIVE MODE"))
    return holder


def _kind_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "retention of " in r.getMessage()]


def test_a_run_whose_task_kind_is_cut_short_still_deletes_keys_and_workers(
    pgtask_engine: Engine, impatient_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with pgtask_engine.begin() as conn:
        finished(conn, 3, age=30 * DAY)
        _expired_key_and_worker(conn)
    caplog.set_level(logging.WARNING, "sqlalchemy_pgtask.retention")
    holder = _tasks_locked(pgtask_engine)
    try:
        # The batch fails (lock_timeout), and so does the listing of its candidates.
        result = run_retention(impatient_engine)
    finally:
        holder.rollback()
        holder.close()
    assert (result.tasks_deleted, result.keys_deleted, result.workers_deleted) == (0, 1, 1)
    assert "finished tasks" in result.kinds_cut_short  # work is left: run it again
    assert "cut short: finished tasks" in result_line(result, queue=None)
    assert keys_left(pgtask_engine) == set()
    warnings = _kind_warnings(caplog)
    assert any("finished tasks" in w and "LockNotAvailable" in w for w in warnings), warnings
    assert run_retention(pgtask_engine).tasks_deleted == 3  # the lock gone, they go
    assert tasks_left(pgtask_engine) == 0


async def test_a_worker_pass_whose_task_kind_is_cut_short_still_deletes_expired_keys(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with pgtask_engine.begin() as conn:
        finished(conn, 3, age=30 * DAY)
        _expired_key_and_worker(conn)
    caplog.set_level(logging.WARNING, "sqlalchemy_pgtask.retention")
    service = Retention(interval=60.0, batch_size=10)
    autocommit = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    held = HeldConnection(autocommit, lock_timeout=0.2, statement_timeout=60.0)
    holder = _tasks_locked(pgtask_engine)
    try:
        async with held.use() as connection:
            await service.run_once(connection)  # no failed pass
    finally:
        holder.rollback()
        holder.close()
        await held.close()
    assert keys_left(pgtask_engine) == set()
    assert tasks_left(pgtask_engine) == 3
    assert any("finished tasks" in w for w in _kind_warnings(caplog))


async def test_a_root_set_aside_rests_across_worker_passes(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with pgtask_engine.begin() as conn:
        held_root, *_ = finished(conn, 5, age=30 * DAY)
        conn.execute(text(
            "INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)"
            " VALUES (:id, 1, 'charge', 0, 'step', 'true')"), {"id": held_root})
    caplog.set_level(logging.WARNING)
    service = Retention(interval=60.0, batch_size=10)
    autocommit = pgtask_async_engine.execution_options(isolation_level="AUTOCOMMIT")
    held = HeldConnection(autocommit, lock_timeout=0.2, statement_timeout=60.0)
    failures: list[str] = []

    def failed(context: Any) -> None:
        failures.append(str(context.original_exception))

    event.listen(pgtask_async_engine.sync_engine, "handle_error", failed)
    holder = pgtask_engine.connect()
    holder.execute(text("SELECT 1 FROM pgtask.checkpoints WHERE task_id = :id FOR UPDATE"),
                   {"id": held_root})
    try:
        async with held.use() as connection:
            await service.run_once(connection)
            # The batch failed, then the held root's own delete: it is set aside.
            assert len(failures) == 2, failures
            first_warnings = [r.getMessage() for r in caplog.records
                              if str(held_root) in r.getMessage()]
            assert len(first_warnings) == 1, first_warnings
            with pgtask_engine.begin() as conn:
                finished(conn, 4, age=30 * DAY)
            await service.run_once(connection)  # the next pass, the row still held
    finally:
        event.remove(pgtask_async_engine.sync_engine, "handle_error", failed)
        holder.rollback()
        holder.close()
        await held.close()
    # The second pass left the resting root out: no failed batch, no try, no warning; the
    # others (those that expired since) went.
    assert len(failures) == 2, failures
    assert [r.getMessage() for r in caplog.records if str(held_root) in r.getMessage()] == (
        first_warnings)
    with pgtask_engine.connect() as conn:
        assert count(conn, "pgtask.tasks") == 1
        left = conn.execute(text("SELECT id FROM pgtask.tasks")).scalar_one()
    assert uuid.UUID(str(left)) == held_root
