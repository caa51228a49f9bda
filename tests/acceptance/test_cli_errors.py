"""Every command ends a database or URL failure in one line and an exit code, never a traceback.

Each case is a real ``pgtask`` subprocess against a real server whose state is the failure: a
role without privileges, a schema with tables missing, a dropped table, a closed port, a URL
that does not parse. Exit code 1 is an operational failure, 2 a usage error.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.pool import NullPool

from tests.support.urls import closed_port_url
from tests.support.workerproc import Database, lines, run_cli

#: Every command that connects, with the arguments it needs besides the URL.
COMMANDS: dict[str, list[str]] = {
    "status": ["status"],
    "task list": ["task", "list"],
    "task show": ["task", "show", str(uuid.UUID(int=1))],
    "task cancel": ["task", "cancel", str(uuid.UUID(int=1))],
    "queue list": ["queue", "list"],
    "queue set": ["queue", "set", "emails", "--pause"],
    "worker": ["worker", "tasks_app:registry"],
    "migrate": ["migrate"],
}
#: The commands that read or write pgtask's tables once connected (not migrate).
TABLE_COMMANDS = [name for name in COMMANDS if name != "migrate"]


def _run(app_dir: Path, command: str, url: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*COMMANDS[command], "--database-url", url, cwd=app_dir, timeout=90)


def _one_line_error(result: subprocess.CompletedProcess[str], code: int, *expected: str) -> str:
    """Exit ``code``, exactly one stderr line ``pgtask: error: ...`` naming the problem."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result
    [line] = lines(result.stderr)
    assert line.startswith("pgtask: error: "), line
    for fragment in expected:
        assert fragment in line, line
    return line


@pytest.fixture
def restricted_url(pgtask_database_url: str) -> Iterator[str]:
    """A URL for a new role that may log in and see schema pgtask, and read nothing in it."""
    role = f"pgtask_restricted_{secrets.token_hex(4)}"
    password = secrets.token_hex(8)
    engine = create_engine(pgtask_database_url, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            try:
                connection.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
            except ProgrammingError as exc:
                pytest.skip(f"the test server's role cannot create roles: {exc.orig}")
            connection.execute(text(f"GRANT USAGE ON SCHEMA pgtask TO {role}"))
        url = make_url(pgtask_database_url).set(username=role, password=password)
        yield url.render_as_string(hide_password=False)
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP OWNED BY {role}"))
            connection.execute(text(f"DROP ROLE {role}"))
        engine.dispose()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_url_with_a_non_numeric_port_is_a_usage_error(app_dir: Path, command: str) -> None:
    result = _run(app_dir, command, "postgresql://app:s3cret@db.example:abc/app")

    line = _one_line_error(result, 2, "invalid database URL", "abc")
    assert "s3cret" not in line  # the password of a URL that did not parse is not echoed


@pytest.mark.parametrize("command", ["task list", "task show", "task cancel", "queue list",
                                     "queue set"])
def test_a_refused_connection_exits_1(app_dir: Path, command: str) -> None:
    result = _run(app_dir, command, closed_port_url())

    _one_line_error(result, 1, "cannot reach the database")


@pytest.mark.parametrize("command", TABLE_COMMANDS)
def test_a_role_without_privileges_gets_permission_denied_and_exit_1(
    app_dir: Path, restricted_url: str, command: str
) -> None:
    result = _run(app_dir, command, restricted_url)

    _one_line_error(result, 1, "permission denied for table", "42501")


def test_migrate_without_privileges_exits_1(
    app_dir: Path, pgtask_empty_database_url: str
) -> None:
    engine = create_engine(pgtask_empty_database_url, poolclass=NullPool)
    role = f"pgtask_restricted_{secrets.token_hex(4)}"
    try:
        with engine.begin() as connection:
            try:
                connection.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
            except ProgrammingError as exc:
                pytest.skip(f"the test server's role cannot create roles: {exc.orig}")
            # PostgreSQL 15 and later no longer let every role create in schema public.
            connection.execute(text(f"REVOKE CREATE ON SCHEMA public FROM {role}, PUBLIC"))
        url = make_url(pgtask_empty_database_url).set(username=role, password="pw")

        result = _run(app_dir, "migrate", url.render_as_string(hide_password=False))

        _one_line_error(result, 1, "permission denied", "42501")
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP OWNED BY {role}"))
            connection.execute(text(f"DROP ROLE {role}"))
        engine.dispose()


@pytest.mark.parametrize("command", TABLE_COMMANDS)
def test_a_partially_installed_schema_exits_1_and_says_to_migrate(
    app_dir: Path, pgtask_empty_database_url: str, command: str
) -> None:
    # What an interrupted hand-made install leaves: the schema and a tasks table, nothing else.
    engine = create_engine(pgtask_empty_database_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.execute(text("CREATE SCHEMA pgtask"))
        connection.execute(text("CREATE TABLE pgtask.tasks (id uuid PRIMARY KEY)"))
    engine.dispose()

    result = _run(app_dir, command, pgtask_empty_database_url)

    _one_line_error(result, 1, "does not exist", "pgtask migrate")


@pytest.mark.parametrize(
    ("table", "command"),
    [
        ("workers", "status"),
        ("workers", "worker"),
        ("attempts", "task show"),
        ("queues", "queue list"),
        ("queues", "queue set"),
        ("queues", "task cancel"),
    ],
)
def test_a_dropped_table_exits_1_and_says_to_migrate(
    app_dir: Path, db: Database, table: str, command: str
) -> None:
    [task_id] = db.enqueue("job", {})
    args = COMMANDS[command]
    if command.startswith("task "):  # a real task, so its attempts and queue are read
        args = [*args[:2], str(task_id)]
    db.execute(f"DROP TABLE pgtask.{table} CASCADE")

    result = run_cli(*args, "--database-url", db.url, cwd=app_dir, timeout=90)

    _one_line_error(result, 1, f'"pgtask.{table}" does not exist', "pgtask migrate")


def test_a_value_the_client_cannot_read_is_not_called_an_unreachable_database(
    app_dir: Path, db: Database
) -> None:
    # A timestamp Python cannot hold, written by hand: the server answered, so "cannot reach
    # the database" sent the operator after the network.
    db.enqueue("job", {})
    db.execute("UPDATE pgtask.tasks SET run_at = 'infinity'")

    result = run_cli("task", "list", "--database-url", db.url, cwd=app_dir, timeout=90)

    _one_line_error(result, 1, "cannot read what the database sent", "infinity")
    assert "cannot reach" not in result.stderr


def test_migrate_to_an_unknown_revision_is_a_usage_error_and_installs_nothing(
    app_dir: Path, pgtask_empty_database_url: str
) -> None:
    # Alembic's own error (CommandError): recognised although the CLI imports Alembic only
    # when a command needs it.
    result = run_cli(
        "migrate", "--database-url", pgtask_empty_database_url, "--revision", "nosuchrev",
        cwd=app_dir, timeout=90,
    )

    _one_line_error(result, 2, "nosuchrev")
    engine = create_engine(pgtask_empty_database_url, poolclass=NullPool)
    with engine.connect() as connection:
        assert connection.execute(
            text("SELECT count(*) FROM pg_namespace WHERE nspname = 'pgtask'")
        ).scalar_one() == 0
    engine.dispose()


def test_a_worker_whose_server_never_answers_gives_up_and_exits_1(app_dir: Path) -> None:
    # Its connect had no time limit: the worker waited for ever (and ignored SIGTERM). The
    # engine it makes from the URL connects with libpq's connect_timeout (10 s) now.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # the kernel completes the handshakes; nobody ever answers
        url = f"postgresql://nobody@127.0.0.1:{server.getsockname()[1]}/nothing"
        result = _run(app_dir, "worker", url)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result
    assert lines(result.stderr)[-1] == (
        "pgtask: error: cannot reach the database: connection timeout expired"
    )
