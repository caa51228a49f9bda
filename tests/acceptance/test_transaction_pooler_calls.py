"""Behind a transaction-mode PgBouncer: the producer and admin calls besides enqueue work too.

Before: only ``enqueue`` / ``enqueue_many`` ran unprepared. ``emit_signal``, ``cancel`` and the
rest became server-side prepared statements after psycopg's fifth run on a connection, and
concurrent callers then failed (DuplicatePreparedStatement, InvalidSqlStatementName, "bind
message supplies N parameters"), their ``_pg3_N`` meeting a server connection another client
had prepared.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Connection, create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    cancel,
    cancel_async,
    emit_signal,
    emit_signal_async,
    explain,
    get_task,
    get_task_async,
)
from sqlalchemy_pgtask.models import AuditEntry, Signal, Task
from tests.support.pgbouncer import transaction_pooler
from tests.support.workerproc import Database

THREADS = 16
PER_THREAD = 20  # each its own transaction; psycopg prepares a statement from its 5th run


@pytest.fixture
def pooled_url(pgtask_database_url: str) -> Iterator[str]:
    with transaction_pooler(pgtask_database_url) as url:
        yield url


def _concurrently(work: Callable[[int, int], None]) -> list[BaseException]:
    failures: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def run(index: int) -> None:
        start.wait()
        for n in range(PER_THREAD):
            try:
                work(index, n)
            except Exception as exc:  # every failure is reported by the caller
                failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return failures


def _counts(db: Database) -> tuple[int, int]:
    with db.engine.connect() as connection:
        signals = connection.execute(select(func.count()).select_from(Signal)).scalar_one()
        cancelled = connection.execute(
            select(func.count()).select_from(Task).where(Task.state == "cancelled")
        ).scalar_one()
    return signals, cancelled


def test_concurrent_signals_cancels_and_reads_through_a_transaction_pooler_all_succeed(
    pooled_url: str, db: Database
) -> None:
    waiting = db.enqueue("job", count=THREADS)
    doomed = db.enqueue("job", count=THREADS * PER_THREAD)
    # The application's own engine, psycopg's defaults (prepare_threshold=5) untouched.
    engine = create_engine(pooled_url, pool_size=THREADS, max_overflow=0)

    def work(index: int, n: int) -> None:
        with engine.begin() as connection:
            emit_signal(connection, waiting[index], "go", {"n": n}, occurrence=n)
            assert cancel(connection, doomed[index * PER_THREAD + n]) == "cancelled"
            assert explain(connection, waiting[index]).task_id == waiting[index]
        with Session(engine) as session, session.begin():
            task = get_task(session, waiting[index])
            assert task is not None
            assert task.id == waiting[index]

    try:
        failures = _concurrently(work)
        with engine.connect() as connection:
            # The caller's own setting is back for its own statements.
            assert connection.connection.driver_connection.prepare_threshold == 5  # type: ignore[union-attr]
    finally:
        engine.dispose()

    assert not failures, [repr(f) for f in failures[:3]]
    assert _counts(db) == (THREADS * PER_THREAD, THREADS * PER_THREAD)


def test_concurrent_async_signals_and_cancels_through_a_transaction_pooler_all_succeed(
    pooled_url: str, db: Database
) -> None:
    waiting = db.enqueue("job", count=THREADS)
    doomed = db.enqueue("job", count=THREADS * PER_THREAD)
    failures: list[BaseException] = []

    async def scenario() -> None:
        engine = create_async_engine(pooled_url, pool_size=THREADS, max_overflow=0)

        async def one(
            connection: AsyncConnection, task: uuid.UUID, target: uuid.UUID, n: int
        ) -> None:
            await emit_signal_async(connection, task, "go", {"n": n}, occurrence=n)
            assert await cancel_async(connection, target) == "cancelled"

        async def produce(index: int) -> None:
            for n in range(PER_THREAD):
                try:
                    async with engine.begin() as connection:
                        await one(connection, waiting[index], doomed[index * PER_THREAD + n], n)
                    async with AsyncSession(engine) as session, session.begin():
                        assert await get_task_async(session, waiting[index]) is not None
                except Exception as exc:  # every failure is reported below
                    failures.append(exc)

        try:
            await asyncio.gather(*(produce(i) for i in range(THREADS)))
        finally:
            await engine.dispose()

    asyncio.run(scenario())

    assert not failures, [repr(f) for f in failures[:3]]
    assert _counts(db) == (THREADS * PER_THREAD, THREADS * PER_THREAD)


def test_a_direct_connection_keeps_preparing_the_library_statements(db: Database) -> None:
    # No pooler: psycopg prepares a repeated emit_signal as usual (no cost on a direct URL).
    [task] = db.enqueue("job")
    with db.engine.connect() as connection:
        for n in range(8):
            emit_signal(connection, task, "go", n, occurrence=n)
        prepared = _prepared_count(connection)
        connection.rollback()
    assert prepared >= 1


def _prepared_count(connection: Connection) -> int:
    count = connection.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements")
    return int(count.scalar_one())


def test_autocommit_cancels_through_a_transaction_pooler_commit_with_their_audit_entries(
    pooled_url: str, db: Database
) -> None:
    # A test-only trigger refuses the audit entries of actor "refused": those cancels must not
    # commit. Each call's own BEGIN ... COMMIT keeps it on one server connection of the pooler.
    with db.engine.begin() as connection:
        connection.exec_driver_sql(
            "CREATE FUNCTION public.refuse_some_audit() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN IF NEW.actor = 'refused' THEN RAISE EXCEPTION 'audit refused';"
            " END IF; RETURN NEW; END $$;"
            " CREATE TRIGGER refuse_some_audit BEFORE INSERT ON pgtask.audit_log"
            " FOR EACH ROW EXECUTE FUNCTION public.refuse_some_audit()"
        )
    doomed = db.enqueue("job", count=THREADS * PER_THREAD)
    engine = create_engine(
        pooled_url, pool_size=THREADS, max_overflow=0, isolation_level="AUTOCOMMIT"
    )
    refusals: list[int] = []

    def work(index: int, n: int) -> None:
        actor = "refused" if n % 2 else "ann"
        with engine.connect() as connection:
            try:
                cancel(connection, doomed[index * PER_THREAD + n], actor=actor)
            except Exception as exc:
                if "audit refused" not in str(exc):
                    raise
                refusals.append(n)

    try:
        failures = _concurrently(work)
    finally:
        engine.dispose()
    assert not failures, [repr(f) for f in failures[:3]]
    assert len(refusals) == THREADS * PER_THREAD // 2
    with db.engine.connect() as connection:
        entries = connection.execute(
            select(func.count()).select_from(AuditEntry).where(AuditEntry.action == "task.cancel")
        ).scalar_one()
    assert _counts(db)[1] == entries == THREADS * PER_THREAD // 2
