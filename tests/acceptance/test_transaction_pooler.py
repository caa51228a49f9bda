"""Behind a transaction-mode PgBouncer (Debian's ``pgbouncer``, started by the test on a free
port): producers enqueue out of the box; a worker refuses to start, in one line naming the fix.

Before: with psycopg's default ``prepare_threshold``, concurrent enqueues through the pooler
failed (DuplicatePreparedStatement, "bind message supplies 14 parameters, but prepared
statement requires 11": psycopg's ``_pg3_N`` of one client bound on a server connection that
another client prepared), and the CLI worker either claimed nothing in silence (its LISTEN
lost) or died with DuplicatePreparedStatement.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.ext.asyncio import create_async_engine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    InvalidOptionError,
    Registry,
    TaskContext,
    Worker,
    WorkerOptions,
    enqueue,
    enqueue_async,
    enqueue_many_async,
)
from sqlalchemy_pgtask.models import Task
from sqlalchemy_pgtask.testing import running_worker
from sqlalchemy_pgtask.worker._session import POOLED_SESSION
from tests.support.pgbouncer import transaction_pooler
from tests.support.workerproc import Database, lines, run_cli

THREADS = 16
PER_THREAD = 20  # 320 enqueues, each its own transaction; psycopg prepares from the 5th


@pytest.fixture
def pooled_url(pgtask_database_url: str) -> Iterator[str]:
    with transaction_pooler(pgtask_database_url) as url:
        yield url


def test_320_concurrent_enqueues_through_a_transaction_pooler_all_commit(
    pooled_url: str, db: Database
) -> None:
    # The application's own engine, psycopg's defaults (prepare_threshold=5) untouched.
    engine = create_engine(pooled_url, pool_size=THREADS, max_overflow=0)
    failures: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def produce(index: int) -> None:
        start.wait()
        for n in range(PER_THREAD):
            try:
                with engine.begin() as connection:
                    enqueue(connection, "job", {"thread": index, "n": n})
            except Exception as exc:  # every failure is reported below
                failures.append(exc)

    try:
        threads = [threading.Thread(target=produce, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        with engine.connect() as connection:
            # The caller's own setting is back for its own statements.
            assert connection.connection.driver_connection.prepare_threshold == 5  # type: ignore[union-attr]
    finally:
        engine.dispose()

    assert not failures, [repr(f) for f in failures[:3]]
    with db.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(Task)).scalar_one() == (
            THREADS * PER_THREAD
        )


def test_the_cli_worker_behind_a_transaction_pooler_refuses_to_start_in_one_line(
    pooled_url: str, app_dir: Path, db: Database
) -> None:
    result = run_cli("worker", "tasks_app:registry", "--database-url", pooled_url,
                     cwd=app_dir, timeout=60)

    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result
    [line] = [text for text in lines(result.stderr) if text.startswith("pgtask: error: ")]
    assert "transaction pooler" in line
    assert "session-mode pool" in line
    assert "direct URL" in line
    assert db.scalar("SELECT count(*) FROM pgtask.workers") == 0  # it never registered


def test_a_worker_in_python_behind_a_transaction_pooler_raises_invalid_option_error(
    pooled_url: str, db: Database
) -> None:
    tasks = Registry()

    @tasks.task("job")
    async def job(ctx: TaskContext, payload: object) -> None:
        return None

    worker = Worker(tasks, pooled_url)
    with pytest.raises(InvalidOptionError) as caught:
        asyncio.run(asyncio.wait_for(worker.run(), 60))
    assert caught.value.field == "database"
    assert POOLED_SESSION in str(caught.value)


def test_a_worker_behind_a_session_mode_pooler_starts_and_runs_a_task(
    pgtask_database_url: str, db: Database
) -> None:
    # The check refuses transaction pooling only: a session-mode pool keeps sessions whole.
    tasks = Registry()
    ran: list[object] = []
    done = asyncio.Event()

    @tasks.task("job")
    async def job(ctx: TaskContext, payload: object) -> None:
        ran.append(payload)
        done.set()

    async def scenario(url: str) -> None:
        async with running_worker(tasks, url, WorkerOptions(poll_interval=0.5)):
            db.enqueue("job", {"n": 1})
            await asyncio.wait_for(done.wait(), 30)

    with transaction_pooler(pgtask_database_url, mode="session") as url:
        asyncio.run(scenario(url))
    assert ran == [{"n": 1}]


def test_concurrent_async_enqueues_through_a_transaction_pooler_all_commit(
    pooled_url: str, db: Database
) -> None:
    async def scenario() -> None:
        engine = create_async_engine(pooled_url, pool_size=THREADS, max_overflow=0)
        try:
            async def produce(index: int) -> None:
                for n in range(PER_THREAD):
                    async with engine.begin() as connection:
                        await enqueue_async(connection, "job", {"task": index, "n": n})
                        request = EnqueueRequest(name="job", payload={"task": index, "m": n})
                        await enqueue_many_async(connection, [request])

            await asyncio.gather(*(produce(i) for i in range(THREADS)))
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    assert db.scalar("SELECT count(*) FROM pgtask.tasks") == 2 * THREADS * PER_THREAD
