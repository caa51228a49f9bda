"""The standalone migrator: up, down to base, up again; idempotent; safe when run concurrently."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import Connection, Engine, text

from sqlalchemy_pgtask.migrations import (
    ADVISORY_LOCK_KEY,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from tests.support.catalog import catalog_snapshot
from tests.support.waiting import wait_until


def _relations(connection: Connection) -> set[str]:
    return set(
        connection.execute(text("""
            SELECT c.relname FROM pg_class AS c
            JOIN pg_namespace AS n ON n.oid = c.relnamespace
            WHERE n.nspname = 'pgtask'
        """)).scalars()
    )


def _functions(connection: Connection) -> set[str]:
    return set(
        connection.execute(text("""
            SELECT p.proname FROM pg_proc AS p
            JOIN pg_namespace AS n ON n.oid = p.pronamespace
            WHERE n.nspname = 'pgtask'
        """)).scalars()
    )


def _revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return current_revision(connection)


def test_current_revision_is_none_before_and_head_after_upgrade(
    pgtask_empty_database_url: str, empty_engine: Engine
) -> None:
    assert _revision(empty_engine) is None

    upgrade(pgtask_empty_database_url)

    assert _revision(empty_engine) == head_revision()


def test_downgrade_to_base_removes_every_object_and_upgrade_rebuilds_the_same_schema(
    pgtask_empty_database_url: str, empty_engine: Engine
) -> None:
    upgrade(pgtask_empty_database_url)
    installed = catalog_snapshot(empty_engine)
    with empty_engine.connect() as connection:
        assert "tasks" in _relations(connection)
        assert _functions(connection)

    downgrade(pgtask_empty_database_url, "pgtask@base")

    with empty_engine.connect() as connection:
        # Only the standalone migrator's (now empty) version table may remain.
        assert _relations(connection) <= {"alembic_version", "alembic_version_pkc"}
        assert _functions(connection) == set()
    assert _revision(empty_engine) is None

    upgrade(pgtask_empty_database_url)

    assert _revision(empty_engine) == head_revision()
    assert catalog_snapshot(empty_engine) == installed


def test_a_second_upgrade_changes_nothing(
    pgtask_empty_database_url: str, empty_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    def upgrades_run() -> list[str]:
        return [r.getMessage() for r in caplog.records if "Running upgrade" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="alembic.runtime.migration"):
        upgrade(pgtask_empty_database_url)
        assert upgrades_run()  # the log does show applied revisions
        caplog.clear()
        with empty_engine.begin() as connection:
            connection.execute(text("INSERT INTO pgtask.queues (name) VALUES ('kept')"))
            tasks_oid = connection.execute(text("SELECT 'pgtask.tasks'::regclass::oid")).scalar()
        installed = catalog_snapshot(empty_engine)

        upgrade(pgtask_empty_database_url)

    assert upgrades_run() == []
    with empty_engine.connect() as connection:
        assert connection.execute(text("SELECT 'pgtask.tasks'::regclass::oid")).scalar() == (
            tasks_oid
        )
        assert connection.execute(text("SELECT name FROM pgtask.queues")).scalars().all() == [
            "kept"
        ]
    assert catalog_snapshot(empty_engine) == installed
    assert _revision(empty_engine) == head_revision()


def _wait_for_advisory_lock_waiters(engine: Engine, count: int, timeout: float = 60) -> None:
    """Poll pg_locks until ``count`` sessions of this database wait for an advisory lock."""

    def waiting() -> bool:
        with engine.connect() as connection:  # a fresh snapshot for every look
            waiters = connection.execute(text("""
                SELECT count(*) FROM pg_locks
                WHERE locktype = 'advisory' AND NOT granted
                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
            """)).scalar_one()
        return bool(waiters >= count)

    wait_until(waiting, timeout, 0.01, message=f"{count} upgrades to wait for the lock")


def _assert_one_schema_at_head(engine: Engine) -> None:
    with engine.connect() as connection:
        versions = connection.execute(text("SELECT version_num FROM pgtask.alembic_version"))
        assert versions.scalars().all() == [head_revision()]
        triggers = connection.execute(text("""
            SELECT count(*) FROM pg_trigger
            WHERE tgrelid = 'pgtask.tasks'::regclass AND tgname = 'tasks_notify_inserted'
        """))
        assert triggers.scalar_one() == 1


_UPGRADE_SCRIPT = (
    "import sys; from sqlalchemy_pgtask.migrations import upgrade; upgrade(sys.argv[1])"
)


def test_concurrent_upgrades_from_two_processes_both_succeed_with_one_schema(
    pgtask_empty_database_url: str, empty_engine: Engine
) -> None:
    # Hold the migrator's advisory lock so both upgrades are certain to overlap: each must
    # wait for it, then run one after the other.
    with empty_engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", _UPGRADE_SCRIPT, pgtask_empty_database_url],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            _wait_for_advisory_lock_waiters(empty_engine, 2)
        finally:
            holder.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_LOCK_KEY})
            holder.commit()
            outputs = [process.communicate(timeout=120)[0] for process in processes]

    assert [process.returncode for process in processes] == [0, 0], outputs
    _assert_one_schema_at_head(empty_engine)


def test_concurrent_upgrades_from_two_threads_both_succeed_with_one_schema(
    pgtask_empty_database_url: str, empty_engine: Engine
) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait()
        try:
            upgrade(pgtask_empty_database_url)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20  # a migration of an empty database takes ~1 s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [thread for thread in threads if thread.is_alive()]
    if hung:  # free the stuck threads before failing, so nothing outlives the test
        with empty_engine.connect() as connection:
            connection.execute(text("""
                SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                WHERE datname = current_database() AND pid <> pg_backend_pid()
            """))
        for thread in hung:
            thread.join(timeout=10)

    assert not hung, "the upgrades deadlocked"
    assert errors == []
    _assert_one_schema_at_head(empty_engine)
