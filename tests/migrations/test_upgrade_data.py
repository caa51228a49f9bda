"""Data written under an older revision keeps working after an upgrade to the head revision."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import IntegrityError

from sqlalchemy_pgtask import Registry, RetryPolicy, TaskContext, WorkerOptions
from sqlalchemy_pgtask.migrations import head_revision, upgrade
from sqlalchemy_pgtask.testing import running_worker


async def test_a_policy_frozen_before_max_attempts_was_frozen_still_lets_its_worker_start(
    pgtask_empty_database_url: str,
) -> None:
    url = pgtask_empty_database_url
    upgrade(url, "pgtask_0001")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:  # what a 0001 worker froze for a max_attempts=3 handler
            conn.execute(text(
                "INSERT INTO pgtask.handler_policies (queue, name, version, retry_kind,"
                " retry_base_seconds, retry_jitter) VALUES ('default', 'job', 1, 'fixed', 1, false)"
            ))
        upgrade(url)
        registry = Registry()

        @registry.task("job", retry=RetryPolicy.fixed(1.0, jitter=False), max_attempts=3)
        async def job(ctx: TaskContext, payload: None) -> None:
            return None

        async with running_worker(registry, url, WorkerOptions(lease_duration=5.0)):
            pass
        with engine.connect() as conn:
            frozen = conn.execute(
                text("SELECT max_attempts FROM pgtask.handler_policies WHERE name = 'job'")
            ).scalar_one()
    finally:
        engine.dispose()
    assert frozen == 3


class IndexState(NamedTuple):
    oid: int
    valid: bool
    definition: str


def task_list_index(conn: Connection) -> IndexState:
    """The catalog's view of ``pgtask.ix_tasks_created``."""
    row = conn.execute(text(
        "SELECT indexrelid::int, indisvalid, pg_get_indexdef(indexrelid) FROM pg_index"
        " WHERE indexrelid = 'pgtask.ix_tasks_created'::regclass"
    )).one()
    return IndexState(*row)


@pytest.fixture
def engine_at_0006(pgtask_empty_database_url: str) -> Iterator[Engine]:
    """An engine on a database at ``pgtask_0006``, the revision before the task list index."""
    upgrade(pgtask_empty_database_url, "pgtask_0006")
    engine = create_engine(pgtask_empty_database_url)
    yield engine
    engine.dispose()


def test_the_task_list_index_built_concurrently_beforehand_is_kept_by_the_upgrade(
    engine_at_0006: Engine,
) -> None:
    with engine_at_0006.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # What docs tell operators of a large table to run before upgrading.
        conn.execute(text(
            "CREATE INDEX CONCURRENTLY ix_tasks_created ON pgtask.tasks (created_at, id)"
        ))
        before = task_list_index(conn)
    upgrade(engine_at_0006)
    with engine_at_0006.connect() as conn:
        after = task_list_index(conn)
        version = conn.execute(text("SELECT version_num FROM pgtask.alembic_version")).scalar()

    assert after == before
    assert version == head_revision()


def test_an_invalid_task_list_index_left_by_a_failed_concurrent_build_is_rebuilt(
    engine_at_0006: Engine,
) -> None:
    with engine_at_0006.begin() as conn:
        conn.execute(text(
            "INSERT INTO pgtask.tasks (queue, name, payload, created_at)"
            " SELECT 'q', 'job', '{}', timestamptz '2026-01-01' FROM generate_series(1, 2)"
        ))
    with engine_at_0006.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # A concurrent build that fails (here: two equal keys under UNIQUE) leaves an invalid
        # index of that name behind, of another definition too.
        with pytest.raises(IntegrityError):
            conn.execute(text(
                "CREATE UNIQUE INDEX CONCURRENTLY ix_tasks_created ON pgtask.tasks (created_at)"
            ))
        left = task_list_index(conn)
    upgrade(engine_at_0006)
    with engine_at_0006.connect() as conn:
        rebuilt = task_list_index(conn)

    assert not left.valid
    assert rebuilt.valid
    assert rebuilt.definition.endswith("USING btree (created_at, id)")
