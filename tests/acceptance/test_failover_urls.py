"""libpq's multi-host failover URL, against two real servers: the worker and the command line
connect to the writable one.

The first host of each URL is a server that only allows read-only transactions
(``default_transaction_read_only``, as a hot standby reports itself), or a closed port (a
primary that is down); the second is the test database. With
``target_session_attrs=read-write`` libpq skips the first and keeps the second: the worker
registers there and runs a task. Before, the URL was refused (exit 2, "invalid literal for
int()").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

from tests.support.servers import second_server
from tests.support.urls import closed_port_url
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, lines, run_cli


@pytest.fixture
def read_only_host(pgtask_database_url: str) -> Iterator[str]:
    """``host:port`` of a second server holding a database of the same name, read-only."""
    name = make_url(pgtask_database_url).database
    with second_server() as server:
        engine = create_engine(server.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
                connection.execute(text("ALTER SYSTEM SET default_transaction_read_only = on"))
                connection.execute(text("SELECT pg_reload_conf()"))
        finally:
            engine.dispose()
        url = make_url(server.url)
        yield f"{url.host}:{url.port}"


def failover_url(first: str, database_url: str) -> str:
    """``postgresql://user@FIRST,HOST:PORT/DB?target_session_attrs=read-write``."""
    url = make_url(database_url)
    user = f"{url.username}@" if url.username else ""
    return (
        f"postgresql://{user}{first},{url.host}:{url.port}/{url.database}"
        "?target_session_attrs=read-write"
    )


def test_a_worker_given_a_standby_first_runs_tasks_on_the_writable_server(
    read_only_host: str, db: Database, workers: WorkerLauncher
) -> None:
    url = failover_url(read_only_host, db.url)
    worker = workers.start("--database-url", url)  # the last --database-url counts
    [task_id] = db.enqueue("job", {"record": True})

    wait_until(lambda: db.state(task_id) == "succeeded", 30, message="the task to succeed",
               describe=worker.describe)
    assert worker.worker_id is not None


def test_the_command_line_skips_a_host_that_is_down(app_dir: Path, db: Database) -> None:
    down = make_url(closed_port_url())
    url = failover_url(f"{down.host}:{down.port}", db.url)
    [task_id] = db.enqueue("job")

    result = run_cli("task", "show", str(task_id), "--database-url", url, cwd=app_dir)

    assert result.returncode == 0, result.stderr
    assert str(task_id) in result.stdout


def test_a_host_list_with_a_bad_port_is_one_line_and_exit_2(app_dir: Path) -> None:
    result = run_cli("status", "--database-url", "postgresql://u:pw@h1:5432,h2:x/db",
                     cwd=app_dir)

    assert result.returncode == 2, result
    [line] = lines(result.stderr)
    assert line.startswith("pgtask: error: invalid database URL 'postgresql://u:***@"), line
    assert "port 'x' of host 'h2:x' is not a port number" in line
