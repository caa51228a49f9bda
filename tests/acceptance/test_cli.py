"""The ``pgtask`` command-line contract: help works, user mistakes exit non-zero with one line
on stderr and never a traceback, and the operator commands do what they say."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import make_url

from sqlalchemy_pgtask import WorkerOptions
from tests.support.urls import closed_port_url
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, lines, run_cli


def _assert_user_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Non-zero, one line on stderr naming the problem, no traceback; returns that line."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    err = lines(result.stderr)
    assert len(err) == 1, result.stderr
    for text in expected:
        assert text in err[0], err[0]
    return err[0]


def test_help_describes_commands_and_worker_options(app_dir: Path) -> None:
    top = run_cli("--help", cwd=app_dir)
    assert top.returncode == 0, top.stderr
    for command in ("worker", "status", "task", "migrate", "demo"):
        assert command in top.stdout

    worker = run_cli("worker", "--help", cwd=app_dir)
    assert worker.returncode == 0, worker.stderr
    for option in (
        "MODULE:ATTRIBUTE", "--database-url", "--queue", "--concurrency", "--lease-duration",
        "--shutdown-grace", "--poll-interval", "--log-level", "--log-format", "SIGTERM",
    ):
        assert option in worker.stdout, option


def test_python_dash_m_runs_the_command(app_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sqlalchemy_pgtask.cli", "--version"], cwd=app_dir,
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pgtask ")


def test_worker_defaults_are_the_worker_options_defaults(app_dir: Path) -> None:
    help_text = " ".join(run_cli("worker", "--help", cwd=app_dir).stdout.split())
    defaults = {f.name: f.default for f in dataclasses.fields(WorkerOptions)}

    for option, field in [
        ("--concurrency N", "concurrency"),
        ("--prefetch N", "prefetch"),
        ("--lease-duration SECONDS", "lease_duration"),
        ("--shutdown-grace SECONDS", "shutdown_grace"),
        ("--poll-interval SECONDS", "poll_interval"),
    ]:
        described = help_text.split(option, 2)[2].split(" --", 1)[0]  # after the usage line
        assert f"(default: {defaults[field]})" in described, (option, described)


@pytest.mark.parametrize("value", ["-1", "1.5", "ten", "100001"])
def test_worker_refuses_a_prefetch_that_is_no_count_in_range(app_dir: Path, value: str) -> None:
    result = run_cli(
        "worker", "tasks_app:registry", f"--prefetch={value}", "--database-url",
        closed_port_url(), cwd=app_dir,
    )
    _assert_user_error(result, "--prefetch", value)
    assert result.returncode == 2


def test_worker_refuses_an_event_loop_it_does_not_know(app_dir: Path) -> None:
    result = run_cli(
        "worker", "tasks_app:registry", "--loop=trio", "--database-url", closed_port_url(),
        cwd=app_dir,
    )
    _assert_user_error(result, "--loop", "trio")
    assert result.returncode == 2


@pytest.mark.parametrize("option", ["--lease-duration", "--shutdown-grace", "--poll-interval"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", "ten"])
def test_worker_refuses_durations_that_are_not_finite_numbers(
    app_dir: Path, option: str, value: str
) -> None:
    # The database is unreachable: a worker that accepted the value would fail on that instead.
    result = run_cli(
        "worker", "tasks_app:registry", f"{option}={value}", "--database-url", closed_port_url(),
        cwd=app_dir,
    )
    line = _assert_user_error(result, option, value)
    assert line.startswith("pgtask: error: ")
    assert result.returncode == 2


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
    result = run_cli(*args, "--database-url", closed_port_url(), cwd=app_dir, timeout=60)
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


def _fields(output: str) -> dict[str, str]:
    """``name: value`` lines of ``task show`` at the task's own indentation."""
    return {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in output.splitlines())
        if key.startswith("  ") and not key.startswith("   ")
    }


def test_task_show_prints_the_task(app_dir: Path, db: Database) -> None:
    [task_id] = db.enqueue("job", {"order": 42}, priority=3, headers={"trace": "t-1"})

    shown = run_cli("task", "show", str(task_id), "--database-url", db.url, cwd=app_dir)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout.splitlines()
    assert out[0] == f"task {task_id}"
    fields = _fields(shown.stdout)
    assert fields["state"] == "pending"
    assert fields["name"] == "job"
    assert fields["priority"] == "3"
    assert fields["completed_at"] == "-"
    assert fields["result"] == "null"
    # Documents are indented JSON below their name.
    payload = out.index("  payload:")
    assert out[payload + 1:payload + 4] == ["    {", '      "order": 42', "    }"]
    assert out[out.index("  headers:") + 2] == '      "trace": "t-1"'
    assert out[-1] == "attempts: none"


def test_task_show_prints_the_error_traceback_as_lines_and_every_attempt(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    [task_id] = db.enqueue("job", {"fail": True}, max_attempts=2)
    wait_until(lambda: db.state(task_id) == "failed", 15, describe=worker.describe)

    shown = run_cli("task", "show", str(task_id), "--database-url", db.url,
                    cwd=workers.directory)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout.splitlines()
    message = "the payload asked this attempt to fail"
    error = out.index(f"  error: handler_error: RuntimeError: {message}")
    assert out[error + 1] == "    Traceback (most recent call last):"
    traceback_lines = out[error + 1:out.index("attempts:")]
    assert any(line.startswith('      File "') for line in traceback_lines)
    assert traceback_lines[-1] == f"    RuntimeError: {message}"
    assert "{" not in "".join(traceback_lines[:1])  # lines, not the repr of a dict
    attempts = out[out.index("attempts:") + 1:]
    assert len(attempts) == 4
    for number, (head, reason) in enumerate(zip(attempts[::2], attempts[1::2], strict=True), 1):
        assert head.startswith(f"  attempt {number}: failed by worker {worker.worker_id}, "
                               "started 20"), head
        assert ", finished 20" in head
        assert reason == f"    handler_error: RuntimeError: {message}"


def test_task_show_json_is_one_machine_readable_document(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    [task_id] = db.enqueue("job", {"sleep": 0}, headers={"trace": "t-1"})
    wait_until(lambda: db.state(task_id) == "succeeded", 15, describe=worker.describe)

    shown = run_cli("task", "show", str(task_id), "--json", "--database-url", db.url,
                    cwd=workers.directory)
    assert shown.returncode == 0, shown.stderr
    assert len(lines(shown.stdout)) == 1
    document = json.loads(shown.stdout)
    task, [attempt] = document["task"], document["attempts"]
    assert (task["id"], task["state"], task["attempt"]) == (str(task_id), "succeeded", 1)
    assert task["headers"] == {"trace": "t-1"}
    assert task["payload"] == {"sleep": 0}
    assert task["result"]["attempt"] == 1
    assert task["error"] is None
    for key in ("created_at", "updated_at", "completed_at", "run_at"):
        assert datetime.fromisoformat(task[key]).utcoffset() is not None, key
    assert attempt["attempt"] == 1
    assert attempt["state"] == "succeeded"
    assert attempt["worker_id"] == str(worker.worker_id)
    assert datetime.fromisoformat(attempt["finished_at"]) >= datetime.fromisoformat(
        attempt["started_at"]
    )
    assert attempt["error"] is None


def test_task_cancel_cancels_a_pending_task(app_dir: Path, db: Database) -> None:
    [task_id] = db.enqueue("job", {"order": 42})

    cancelled = run_cli("task", "cancel", str(task_id), "--database-url", db.url, cwd=app_dir)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled" in cancelled.stdout
    task = db.task(task_id)
    assert task.state == "cancelled"
    assert task.completed_at is not None

    # Cancelling again: the task has already finished, which is not an error.
    again = run_cli("task", "cancel", str(task_id), "--database-url", db.url, cwd=app_dir)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"task {task_id} had already finished: cancelled"


def test_cancelling_a_finished_task_says_how_it_finished(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    [task_id] = db.enqueue("job", {"sleep": 0})
    wait_until(lambda: db.state(task_id) == "succeeded", 15, describe=worker.describe)

    result = run_cli("task", "cancel", str(task_id), "--database-url", db.url,
                     cwd=workers.directory)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"task {task_id} had already finished: succeeded"
    assert result.stderr == ""
    assert db.state(task_id) == "succeeded"


def test_cancelling_an_unknown_task_says_not_found(app_dir: Path, db: Database) -> None:
    missing = uuid.uuid4()

    result = run_cli("task", "cancel", str(missing), "--database-url", db.url, cwd=app_dir)

    assert _assert_user_error(result) == f"pgtask: error: no task with id {missing}"
    assert result.returncode == 1


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
    missing = uuid.uuid4()
    unknown = run_cli("task", action, str(missing), "--database-url", db.url, cwd=app_dir)
    _assert_user_error(unknown, f"no task with id {missing}")
    assert unknown.returncode == 1
    malformed = run_cli("task", action, "not-a-uuid", "--database-url", db.url, cwd=app_dir)
    _assert_user_error(malformed, "not-a-uuid")
    assert malformed.returncode == 2


def test_task_list_prints_the_newest_tasks_first_one_line_each(
    app_dir: Path, db: Database
) -> None:
    [oldest] = db.enqueue("job", {}, queue="emails")
    [middle] = db.enqueue("job-sync", {})
    [newest] = db.enqueue("job", {}, max_attempts=3)
    db.execute("UPDATE pgtask.tasks SET state = 'succeeded', completed_at = now() WHERE id = :id",
               id=middle)

    listed = run_cli("task", "list", "--database-url", db.url, cwd=app_dir)

    assert listed.returncode == 0, listed.stderr
    header, *rows = lines(listed.stdout)
    assert header.split() == ["ID", "QUEUE", "TASK", "STATE", "ATTEMPT", "CREATED", "UPDATED"]
    assert [row.split()[0] for row in rows] == [str(newest), str(middle), str(oldest)]
    assert rows[0].split()[1:6] == ["default", "job", "v1", "pending", "0/3"]
    assert rows[1].split()[1:5] == ["default", "job-sync", "v1", "succeeded"]
    created, updated = rows[2].split()[-2:]
    assert datetime.fromisoformat(created.replace("Z", "+00:00")) <= datetime.fromisoformat(
        updated.replace("Z", "+00:00")
    )


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["--state", "succeeded"], ["middle"]),
        (["--queue", "emails"], ["oldest"]),
        (["--name", "job"], ["newest", "oldest"]),
        (["--name", "job", "--state", "pending", "--queue", "default"], ["newest"]),
        (["--limit", "2"], ["newest", "middle"]),
        (["--queue", "nothing-here"], []),
        (["--key", "customer-1"], ["middle"]),
        (["--key", "customer-1", "--name", "job"], []),
    ],
)
def test_task_list_filters(
    app_dir: Path, db: Database, filters: list[str], expected: list[str]
) -> None:
    ids = {
        "oldest": db.enqueue("job", {}, queue="emails")[0],
        "middle": db.enqueue("job-sync", {}, concurrency_key="customer-1")[0],
        "newest": db.enqueue("job", {})[0],
    }
    db.execute("UPDATE pgtask.tasks SET state = 'succeeded', completed_at = now() WHERE id = :id",
               id=ids["middle"])

    listed = run_cli("task", "list", *filters, "--database-url", db.url, cwd=app_dir)

    assert listed.returncode == 0, listed.stderr
    out = lines(listed.stdout)
    if not expected:
        assert out == ["no tasks match"]
        return
    rows = [line.split()[0] for line in out[1:] if not line.startswith("(")]
    assert rows == [str(ids[name]) for name in expected]
    if "--limit" in filters:  # a full page says how to get the next one
        assert out[-1] == f"(first 2; older ones: add --before {ids['middle']})"
        page = run_cli("task", "list", "--before", str(ids["middle"]), "--database-url", db.url,
                       cwd=app_dir)
        assert [line.split()[0] for line in lines(page.stdout)[1:]] == [str(ids["oldest"])]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["--state", "done"], "invalid choice: 'done'"),
        (["--state", "PENDING"], "invalid choice"),
        (["--queue", "no spaces"], "'no spaces'"),
        (["--name", ""], "must not be empty"),
        (["--limit", "0"], "--limit"),
        (["--limit", "many"], "--limit"),
        (["--before", "yesterday"], "'yesterday' is not a UUID"),
    ],
)
def test_task_list_refuses_bad_filters_as_usage_errors(
    app_dir: Path, filters: list[str], expected: str
) -> None:
    # Refused before connecting: the database here is unreachable.
    result = run_cli("task", "list", *filters, "--database-url", closed_port_url(),
                     cwd=app_dir)
    _assert_user_error(result, expected)
    assert result.returncode == 2


def test_status_shows_every_queue_with_finished_counts_pause_and_capacity(
    app_dir: Path, db: Database
) -> None:
    db.enqueue("job", {}, count=2)
    [done] = db.enqueue("job", {})
    db.execute("UPDATE pgtask.tasks SET state = 'failed', completed_at = now() WHERE id = :id",
               id=done)
    configured = run_cli("queue", "set", "emails", "--capacity", "10", "--pause",
                         "--database-url", db.url, cwd=app_dir)
    assert configured.returncode == 0, configured.stderr
    db.enqueue("job", {}, queue="emails", count=3)

    result = run_cli("status", "--database-url", db.url, cwd=app_dir)

    assert result.returncode == 0, result.stderr
    out = lines(result.stdout)
    queues = out.index("queues:")
    assert out[queues + 1] == "  default: 2 pending (2 due), 0 running, 0 waiting"
    assert out[queues + 2] == (
        "    finished: 0 succeeded, 1 failed, 0 cancelled; capacity unlimited; not paused"
    )
    assert out[queues + 3] == "  emails: 3 pending (3 due), 0 running, 0 waiting"
    assert out[queues + 4].startswith(
        "    finished: 0 succeeded, 0 failed, 0 cancelled; capacity 3/10 used; paused since 20"
    )
    assert out[queues + 4].endswith("Z")


def test_status_of_an_empty_install_says_so(app_dir: Path, db: Database) -> None:
    result = run_cli("status", "--database-url", db.url, cwd=app_dir)
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout) == ["live workers: 0", "queues: none has settings or tasks"]


def test_queue_list_and_set_print_the_settings(app_dir: Path, db: Database) -> None:
    empty = run_cli("queue", "list", "--database-url", db.url, cwd=app_dir)
    assert lines(empty.stdout) == ["no queue has settings; every queue uses the defaults"]

    changed = run_cli("queue", "set", "emails", "--capacity", "5", "--terminal-retention", "60",
                      "--database-url", db.url, cwd=app_dir)
    assert changed.returncode == 0, changed.stderr
    expected = ("emails: active, capacity 0/5, terminal retention 60s, "
                "idempotency retention 2592000s, rate unlimited, starvation timeout none")
    assert lines(changed.stdout) == [expected]
    listed = run_cli("queue", "list", "--database-url", db.url, cwd=app_dir)
    assert lines(listed.stdout) == [expected]


def test_worker_logs_one_json_object_per_line_with_log_format_json(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start("--log-format", "json", "--log-level", "debug")
    [task_id] = db.enqueue("job", {"sleep": 0})
    wait_until(lambda: db.state(task_id) == "succeeded", 15, describe=worker.describe)

    records = [json.loads(line) for line in lines(worker.log())]

    assert records, worker.describe()
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record), record
        assert datetime.fromisoformat(record["time"]).utcoffset() is not None
    assert any(
        record["logger"].startswith("sqlalchemy_pgtask") and str(worker.worker_id)
        in record["message"]
        for record in records
    ), records
