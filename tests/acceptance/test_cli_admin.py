"""The administrative commands end to end, as an operator runs them: ``pgtask task retry`` and
``cancel`` with an actor and a reason, ``queue pause|resume|set`` with rate and starvation
settings, and ``pgtask audit`` to read what was done."""

from __future__ import annotations

import getpass
import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.workerproc import Database, lines, run_cli


def _ok(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return lines(result.stdout)


def _error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one ``pgtask: error: ...`` line of a command that failed with ``code``."""
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    [line] = lines(result.stderr)
    assert line.startswith("pgtask: error: "), line
    return line


def _audit(db: Database) -> list[dict[str, object]]:
    rows = db.rows("SELECT * FROM pgtask.audit_log ORDER BY id")
    return [dict(row._mapping) for row in rows]


def test_help_names_the_administrative_commands_and_the_default_actor(app_dir: Path) -> None:
    top = _ok(run_cli("--help", cwd=app_dir))
    assert any(line.strip().startswith("audit") for line in top)
    task = " ".join(run_cli("task", "--help", cwd=app_dir).stdout.split())
    assert "retry" in task
    retry = " ".join(run_cli("task", "retry", "--help", cwd=app_dir).stdout.split())
    for text in ("--actor", "--reason", "getpass.getuser()", "fresh budget"):
        assert text in retry, text
    queue = " ".join(run_cli("queue", "--help", cwd=app_dir).stdout.split())
    for text in ("pause", "resume", "set", "list"):
        assert text in queue, text
    settings = " ".join(run_cli("queue", "set", "--help", cwd=app_dir).stdout.split())
    for text in ("--rate-limit", "--no-rate-limit", "100/30s", "--starvation-timeout",
                 "--no-starvation-timeout", "--actor"):
        assert text in settings, text


def test_cancel_then_retry_a_task_and_read_the_audit_log(app_dir: Path, db: Database) -> None:
    [task_id] = db.enqueue("job", {"order": 42})

    cancelled = _ok(run_cli("task", "cancel", str(task_id), "--actor", "alice", "--reason",
                            "duplicate order", "--database-url", db.url, cwd=app_dir))
    assert cancelled == [f"task {task_id}: cancelled"]
    retried = _ok(run_cli("task", "retry", str(task_id), "--database-url", db.url,
                          cwd=app_dir))
    assert retried == [f"task {task_id}: pending again (was cancelled)"]

    task = db.task(task_id)
    assert (task.state, task.completed_at, task.error) == ("pending", None, None)
    entries = _audit(db)
    assert [(e["action"], e["actor"], e["reason"]) for e in entries] == [
        ("task.cancel", "alice", "duplicate order"),
        ("task.retry", getpass.getuser(), None),  # the operating system user by default
    ]

    shown = _ok(run_cli("audit", "--task", str(task_id), "--database-url", db.url,
                        cwd=app_dir))
    assert shown[0].split() == ["ID", "TIME", "ACTOR", "ACTION", "TARGET", "REASON", "DETAILS"]
    assert "task.retry" in shown[1]
    assert getpass.getuser() in shown[1]
    assert "task.cancel" in shown[2]
    assert "duplicate order" in shown[2]
    assert f"task {task_id}, queue default" in shown[2]
    assert shown[2].endswith('{"previous_state": "pending", "state": "cancelled"}')

    document = json.loads(run_cli("audit", "--json", "--database-url", db.url,
                                  cwd=app_dir).stdout)
    assert [(e["action"], e["task_id"]) for e in document] == [
        ("task.retry", str(task_id)), ("task.cancel", str(task_id)),
    ]
    assert document[1]["details"] == {"previous_state": "pending", "state": "cancelled"}
    assert document[0]["id"] > document[1]["id"]


@pytest.mark.parametrize("state", ["pending", "succeeded"])
def test_retrying_a_task_that_is_not_failed_or_cancelled_exits_1_and_writes_nothing(
    app_dir: Path, db: Database, state: str
) -> None:
    [task_id] = db.enqueue("job", {})
    if state == "succeeded":
        db.execute("UPDATE pgtask.tasks SET state = 'succeeded', completed_at = now()"
                   " WHERE id = :id", id=task_id)

    line = _error(run_cli("task", "retry", str(task_id), "--database-url", db.url,
                          cwd=app_dir), 1)

    assert line == (f"pgtask: error: task {task_id} is {state}; only failed or cancelled "
                    "tasks can be retried")
    assert db.state(task_id) == state
    assert _audit(db) == []


def test_retrying_an_unknown_task_exits_1(app_dir: Path, db: Database) -> None:
    missing = uuid.uuid4()
    line = _error(run_cli("task", "retry", str(missing), "--database-url", db.url,
                          cwd=app_dir), 1)
    assert line == f"pgtask: error: no task with id {missing}"


def test_retrying_into_a_full_queue_exits_1_and_writes_nothing(
    app_dir: Path, db: Database
) -> None:
    _ok(run_cli("queue", "set", "emails", "--capacity", "1", "--database-url", db.url,
                cwd=app_dir))
    [first] = db.enqueue("job", {}, queue="emails")
    _ok(run_cli("task", "cancel", str(first), "--database-url", db.url, cwd=app_dir))
    db.enqueue("job", {}, queue="emails")  # takes the only place
    entries = len(_audit(db))

    line = _error(run_cli("task", "retry", str(first), "--database-url", db.url,
                          cwd=app_dir), 1)

    assert f"cannot retry task {first}" in line
    assert "capacity of 1" in line
    assert db.state(first) == "cancelled"
    assert len(_audit(db)) == entries


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["task", "retry", "not-a-uuid"], "not a UUID"),
        (["task", "retry", str(uuid.UUID(int=1)), "--actor", ""], "actor"),
        (["task", "cancel", str(uuid.UUID(int=1)), "--reason", "r" * 1001], "reason"),
        (["queue", "pause", "no spaces"], "'no spaces'"),
        (["queue", "set", "q", "--rate-limit", "100/fortnight"], "is not a rate"),
        (["queue", "set", "q", "--rate-limit", "100/s", "--rate-period", "2"], "not both"),
        (["queue", "set", "q", "--rate-period", "2"], "needs --rate-limit"),
        (["queue", "set", "q", "--rate-limit", "0/s"], "must be 1 to"),
        (["queue", "set", "q", "--rate-limit", "5/0s"], "must be positive"),
        (["queue", "set", "q", "--rate-limit", "5/s", "--no-rate-limit"], "not allowed"),
        (["queue", "set", "q", "--starvation-timeout", "0"], "positive"),
        (["audit", "--limit", "0"], "--limit"),
        (["audit", "--task", "nope"], "not a UUID"),
    ],
)
def test_mistakes_are_usage_errors_and_write_nothing(
    app_dir: Path, db: Database, args: list[str], expected: str
) -> None:
    line = _error(run_cli(*args, "--database-url", db.url, cwd=app_dir), 2)
    assert expected in line, line
    assert _audit(db) == []
    assert db.rows("SELECT * FROM pgtask.queues") == []


def test_pause_resume_and_rate_settings_are_shown_and_audited(
    app_dir: Path, db: Database
) -> None:
    paused = _ok(run_cli("queue", "pause", "emails", "--actor", "ops", "--reason", "outage",
                         "--database-url", db.url, cwd=app_dir))
    assert paused[0].startswith("emails: paused since 20")
    resumed = _ok(run_cli("queue", "resume", "emails", "--actor", "ops",
                          "--database-url", db.url, cwd=app_dir))
    assert resumed[0].startswith("emails: active, ")

    _ok(run_cli("queue", "set", "emails", "--rate-limit", "100/30s", "--starvation-timeout",
                "120", "--actor", "ops", "--database-url", db.url, cwd=app_dir))
    _ok(run_cli("queue", "set", "reports", "--rate-limit", "5000/hour", "--database-url", db.url,
                cwd=app_dir))
    _ok(run_cli("queue", "set", "bare", "--rate-limit", "7", "--rate-period", "2",
                "--database-url", db.url, cwd=app_dir))
    _ok(run_cli("queue", "set", "bare-second", "--rate-limit", "9", "--database-url", db.url,
                cwd=app_dir))
    assert [tuple(r) for r in db.rows(
        "SELECT name, rate_limit, rate_period_seconds FROM pgtask.queues"
        " WHERE name LIKE 'bare%' ORDER BY name"
    )] == [("bare", 7, 2.0), ("bare-second", 9, 1.0)]
    db.execute("DELETE FROM pgtask.queues WHERE name LIKE 'bare%'")
    listed = _ok(run_cli("queue", "list", "--database-url", db.url, cwd=app_dir))
    assert listed == [
        "emails: active, capacity unlimited, terminal retention 604800s, idempotency "
        "retention 2592000s, rate 100/30s, starvation timeout 120s",
        "reports: active, capacity unlimited, terminal retention 604800s, idempotency "
        "retention 2592000s, rate 5000/h, starvation timeout none",
    ]
    row = db.row("SELECT rate_limit, rate_period_seconds, starvation_timeout_seconds"
                 " FROM pgtask.queues WHERE name = 'emails'")
    assert tuple(row or ()) == (100, 30.0, 120.0)

    _ok(run_cli("queue", "set", "emails", "--no-rate-limit", "--no-starvation-timeout",
                "--database-url", db.url, cwd=app_dir))
    [emails, _] = _ok(run_cli("queue", "list", "--database-url", db.url, cwd=app_dir))
    assert emails.endswith("rate unlimited, starvation timeout none")

    by_queue = json.loads(run_cli("audit", "--queue", "emails", "--json", "--database-url",
                                  db.url, cwd=app_dir).stdout)
    assert [(e["action"], e["actor"]) for e in by_queue] == [
        ("queue.configure", getpass.getuser()),
        ("queue.configure", "ops"),
        ("queue.resume", "ops"),
        ("queue.pause", "ops"),
    ]
    assert by_queue[3]["reason"] == "outage"
    assert by_queue[1]["details"] == {"changes": {
        "rate_limit": {"from": None, "to": 100},
        "rate_period_seconds": {"from": None, "to": 30.0},
        "starvation_timeout_seconds": {"from": None, "to": 120.0},
    }}


def test_audit_pages_with_limit_and_before(app_dir: Path, db: Database) -> None:
    for name in ("a", "b", "c"):
        _ok(run_cli("queue", "pause", name, "--database-url", db.url, cwd=app_dir))

    first = _ok(run_cli("audit", "--limit", "2", "--database-url", db.url, cwd=app_dir))
    assert len(first) == 4  # header, two entries, the hint
    last_id = first[2].split()[0]
    assert first[3] == f"(first 2; older ones: add --before {last_id})"
    rest = _ok(run_cli("audit", "--limit", "2", "--before", last_id, "--database-url", db.url,
                       cwd=app_dir))
    assert len(rest) == 2
    assert "queue a" in rest[1]

    none = _ok(run_cli("audit", "--schedule", "nightly", "--database-url", db.url,
                       cwd=app_dir))
    assert none == ["no audit entries match"]
