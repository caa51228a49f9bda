"""The ``pgtask`` command-line contract: help works, user mistakes exit non-zero with one line
on stderr and never a traceback, and the operator commands do what they say."""

from __future__ import annotations

import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from sqlalchemy import make_url

from tests.acceptance.workerproc import Database, WorkerLauncher, lines, run_cli, wait_until


def _assert_user_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Non-zero, one line on stderr naming the problem, no traceback; returns that line."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    err = lines(result.stderr)
    assert len(err) == 1, result.stderr
    for text in expected:
        assert text in err[0], err[0]
    return err[0]


def _closed_port_url() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def test_help_describes_commands_and_worker_options(app_dir: Path) -> None:
    top = run_cli("--help", cwd=app_dir)
    assert top.returncode == 0, top.stderr
    for command in ("worker", "status", "task", "migrate", "demo"):
        assert command in top.stdout

    worker = run_cli("worker", "--help", cwd=app_dir)
    assert worker.returncode == 0, worker.stderr
    for option in (
        "MODULE:ATTRIBUTE", "--database-url", "--queue", "--concurrency", "--lease-duration",
        "--shutdown-grace", "--poll-interval", "--log-level", "SIGTERM",
    ):
        assert option in worker.stdout, option


@pytest.mark.parametrize("command", ["worker", "status"])
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("nonsense", "invalid database URL"),
        ("sqlite:///tasks.db", "needs PostgreSQL"),
        ("mysql://app@localhost/app", "needs PostgreSQL"),
    ],
)
def test_bad_database_url_is_a_usage_error(
    app_dir: Path, command: str, url: str, expected: str
) -> None:
    args = ["worker", "tasks_app:registry"] if command == "worker" else ["status"]
    result = run_cli(*args, "--database-url", url, cwd=app_dir)
    _assert_user_error(result, expected)
    assert result.returncode == 2


def test_missing_database_url_is_a_usage_error(app_dir: Path) -> None:
    result = run_cli("status", cwd=app_dir)
    _assert_user_error(result, "PGTASK_DATABASE_URL")
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("no_such_module:registry", "cannot import module 'no_such_module'"),
        ("tasks_app:missing", "has no attribute 'missing'"),
        ("tasks_app:not_a_registry", "not a sqlalchemy_pgtask.Registry"),
        ("tasks_app", "MODULE:ATTRIBUTE"),
    ],
)
def test_bad_registry_target_is_a_usage_error(
    app_dir: Path, pgtask_database_url: str, target: str, expected: str
) -> None:
    result = run_cli("worker", target, "--database-url", pgtask_database_url, cwd=app_dir)
    _assert_user_error(result, expected)
    assert result.returncode == 2


def test_module_that_fails_to_import_is_reported_without_traceback(
    app_dir: Path, pgtask_database_url: str
) -> None:
    (app_dir / "broken_app.py").write_text("import no_such_dependency_xyz\n")
    result = run_cli("worker", "broken_app:registry", "--database-url", pgtask_database_url,
                     cwd=app_dir)
    _assert_user_error(result, "broken_app", "no_such_dependency_xyz")


@pytest.mark.parametrize("command", ["worker", "status", "migrate"])
def test_unreachable_server_exits_1(app_dir: Path, command: str) -> None:
    args = {"worker": ["worker", "tasks_app:registry"], "status": ["status"],
            "migrate": ["migrate"]}[command]
    result = run_cli(*args, "--database-url", _closed_port_url(), cwd=app_dir, timeout=60)
    _assert_user_error(result, "cannot reach the database")
    assert result.returncode == 1


@pytest.mark.parametrize("command", ["worker", "status"])
def test_schema_not_installed_points_at_migrate(
    app_dir: Path, pgtask_empty_database_url: str, command: str
) -> None:
    args = ["worker", "tasks_app:registry"] if command == "worker" else ["status"]
    result = run_cli(*args, "--database-url", pgtask_empty_database_url, cwd=app_dir)
    line = _assert_user_error(result)
    assert "pgtask migrate" in line or "alembic upgrade heads" in line
    assert result.returncode == 1


def test_migrate_installs_the_schema_and_is_idempotent(
    app_dir: Path, pgtask_empty_database_url: str
) -> None:
    # Any PostgreSQL URL form is accepted: plain libpq and other drivers' names.
    plain = make_url(pgtask_empty_database_url).set(drivername="postgresql")
    url = plain.render_as_string(hide_password=False)
    for _ in range(2):
        result = run_cli("migrate", "--database-url", url, cwd=app_dir)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
    status = run_cli("status", "--database-url", url, cwd=app_dir)
    assert status.returncode == 0, status.stderr
    assert "live workers: 0" in status.stdout

    database = Database(pgtask_empty_database_url)
    try:
        assert database.scalar("SELECT version_num FROM pgtask.alembic_version") is not None
        [task_id] = database.enqueue("job", {"n": 1})
        assert database.state(task_id) == "pending"
    finally:
        database.close()


def test_task_show_prints_the_task(app_dir: Path, db: Database) -> None:
    [task_id] = db.enqueue("job", {"order": 42}, priority=3)

    shown = run_cli("task", "show", str(task_id), "--database-url", db.url, cwd=app_dir)
    assert shown.returncode == 0, shown.stderr
    assert str(task_id) in shown.stdout
    fields = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in lines(shown.stdout))
    }
    assert fields["state"] == "pending"
    assert fields["name"] == "job"
    assert fields["priority"] == "3"
    assert "42" in fields["payload"]


def test_task_cancel_cancels_a_pending_task(app_dir: Path, db: Database) -> None:
    [task_id] = db.enqueue("job", {"order": 42})

    cancelled = run_cli("task", "cancel", str(task_id), "--database-url", db.url, cwd=app_dir)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled" in cancelled.stdout
    task = db.task(task_id)
    assert task.state == "cancelled"
    assert task.completed_at is not None

    # Cancelling again: the task has already finished.
    again = run_cli("task", "cancel", str(task_id), "--database-url", db.url, cwd=app_dir)
    _assert_user_error(again, str(task_id))


def test_task_cancel_stops_a_running_handler(db: Database, workers: WorkerLauncher) -> None:
    worker = workers.start()
    [task_id] = db.enqueue("job", {"sleep": 60})
    wait_until(lambda: db.state(task_id) == "running", 15, describe=worker.describe)

    requested = run_cli("task", "cancel", str(task_id), "--database-url", db.url,
                        cwd=workers.directory)
    assert requested.returncode == 0, requested.stderr
    assert "cancellation requested" in requested.stdout
    # The worker sees the request at its next lease renewal (a third of the lease).
    wait_until(
        lambda: db.state(task_id) == "cancelled", 10, message="the running task to be cancelled",
        describe=worker.describe,
    )
    task = db.task(task_id)
    assert (task.attempt, task.failed_attempts, task.result) == (1, 0, None)
    assert [a.state for a in db.attempts(task_id)] == ["cancelled"]
    assert worker.alive()


def test_task_show_lists_the_attempts_of_a_task_a_worker_ran(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    [task_id] = db.enqueue("job", {"sleep": 0})
    wait_until(lambda: db.state(task_id) == "succeeded", 15, describe=worker.describe)

    shown = run_cli("task", "show", str(task_id), "--database-url", db.url,
                    cwd=workers.directory)
    assert shown.returncode == 0, shown.stderr
    assert f"attempt 1: succeeded by worker {worker.worker_id}" in shown.stdout


@pytest.mark.parametrize("action", ["show", "cancel"])
def test_unknown_or_malformed_task_id_fails_cleanly(
    app_dir: Path, db: Database, action: str
) -> None:
    unknown = run_cli("task", action, str(uuid.uuid4()), "--database-url", db.url, cwd=app_dir)
    _assert_user_error(unknown)
    malformed = run_cli("task", action, "not-a-uuid", "--database-url", db.url, cwd=app_dir)
    _assert_user_error(malformed, "not-a-uuid")
