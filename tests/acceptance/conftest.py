"""Fixtures for the acceptance tests: a test database, the tasks module, and worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.workerproc import Database, WorkerLauncher, write_tasks_app


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """A working directory holding ``tasks_app.py``, where worker processes start."""
    write_tasks_app(tmp_path)
    return tmp_path


@pytest.fixture
def db(pgtask_database_url: str) -> Iterator[Database]:
    """This test's migrated database, with the ``acceptance_runs`` table handlers record into."""
    database = Database(pgtask_database_url)
    try:
        database.create_runs_table()
        yield database
    finally:
        database.close()


@pytest.fixture
def workers(app_dir: Path, db: Database) -> Iterator[WorkerLauncher]:
    """Starts ``pgtask worker`` subprocesses; kills and reaps every one of them at teardown."""
    launcher = WorkerLauncher(app_dir, db)
    try:
        yield launcher
    finally:
        launcher.close()
