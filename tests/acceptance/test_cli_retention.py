"""``pgtask retention run``: deletes what is past its queue's retention, says what it deleted,
and reports mistakes as one line with the usage exit code."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.urls import closed_port_url
from tests.support.workerproc import Database, lines, run_cli


def _old_history(db: Database) -> None:
    db.execute("INSERT INTO pgtask.queues (name, terminal_retention_seconds)"
               " VALUES ('short', 60)")
    db.execute(
        "INSERT INTO pgtask.tasks (queue, name, payload, state, attempt, max_attempts,"
        " completed_at, idempotency_key)"
        " SELECT q, 'job', 'null', 'succeeded', 1, 1, pgtask.now() - make_interval(secs => age),"
        "  q || '-' || age || '-' || i"
        " FROM (VALUES ('short', 120), ('default', 40 * 86400), ('default', 86400))"
        "  AS v(q, age), generate_series(1, 5) AS i"
    )
    db.execute("INSERT INTO pgtask.idempotency_keys (queue, key, task_id)"
               " SELECT queue, idempotency_key, id FROM pgtask.tasks")
    db.execute(
        "INSERT INTO pgtask.workers (id, queues, version, hostname, pid, concurrency,"
        " expires_at) VALUES (gen_random_uuid(), '{default}', '1', 'h', 1, 1,"
        " pgtask.now() - interval '1 day')"
    )


def _assert_usage_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = lines(result.stderr)
    assert line.startswith("pgtask: error: ")
    for text in expected:
        assert text in line, line


def test_retention_run_deletes_and_says_what(app_dir: Path, db: Database) -> None:
    _old_history(db)
    short = run_cli("retention", "run", "--queue", "short", "--database-url", db.url,
                    cwd=app_dir)
    assert short.returncode == 0, short.stderr
    assert lines(short.stdout) == [
        "deleted 5 finished tasks, 0 idempotency keys of queue short in 2 batches"
    ]
    assert db.scalar("SELECT count(*) FROM pgtask.tasks WHERE queue = 'short'") == 0

    everything = run_cli("retention", "run", "--batch-size", "2", "--database-url", db.url,
                         cwd=app_dir)
    assert everything.returncode == 0, everything.stderr
    (line,) = lines(everything.stdout)
    # 5 old tasks of 'default' (40 days), and their keys (30 days: expired); the tasks of a
    # day ago and every other key stay. One worker row expired a day ago.
    assert line.startswith("deleted 5 finished tasks, 5 idempotency keys, 1 worker row in ")
    assert db.scalar("SELECT count(*) FROM pgtask.tasks") == 5
    assert db.scalar("SELECT count(*) FROM pgtask.idempotency_keys") == 10
    assert db.scalar("SELECT count(*) FROM pgtask.workers") == 0

    again = run_cli("retention", "run", "--database-url", db.url, cwd=app_dir)
    assert lines(again.stdout)[0].startswith("deleted 0 finished tasks, 0 idempotency keys")


def test_max_batches_bounds_a_run(app_dir: Path, db: Database) -> None:
    _old_history(db)
    result = run_cli("retention", "run", "--batch-size", "1", "--max-batches", "2",
                     "--queue", "default", "--database-url", db.url, cwd=app_dir)
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout)[0].startswith("deleted 2 finished tasks")
    assert lines(result.stdout)[0].endswith(" (stopped at --max-batches: more may be left)")
    assert db.scalar("SELECT count(*) FROM pgtask.tasks WHERE queue = 'default'") == 8


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "many"], "--batch-size"),
        (["--max-batches", "-1"], "--max-batches"),
        (["--worker-retention", "nan"], "--worker-retention"),
        (["--queue", "no spaces"], "--queue"),
        (["--unknown"], "--unknown"),
    ],
)
def test_bad_options_are_usage_errors(app_dir: Path, args: list[str], expected: str) -> None:
    # The database is unreachable: a command that accepted the option would fail on that.
    result = run_cli("retention", "run", *args, "--database-url", closed_port_url(),
                     cwd=app_dir)
    _assert_usage_error(result, expected)


def test_a_missing_action_or_url_is_a_usage_error(app_dir: Path) -> None:
    _assert_usage_error(run_cli("retention", cwd=app_dir), "ACTION")
    _assert_usage_error(run_cli("retention", "run", cwd=app_dir), "PGTASK_DATABASE_URL")


def test_an_unreachable_database_is_an_operational_failure(app_dir: Path) -> None:
    result = run_cli("retention", "run", "--database-url", closed_port_url(), cwd=app_dir)
    assert result.returncode == 1, result
    assert lines(result.stderr)[0].startswith("pgtask: error: cannot reach the database")


def test_a_database_without_the_schema_says_so(
    app_dir: Path, pgtask_empty_database_url: str
) -> None:
    result = run_cli("retention", "run", "--database-url", pgtask_empty_database_url,
                     cwd=app_dir)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    assert "schema" in lines(result.stderr)[0]
