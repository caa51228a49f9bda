"""``pgtask task explain`` end to end, as an operator runs it: the plain-words summary, the
``--json`` document, and one-line errors for an unknown task or an id that is no UUID.

A real ``pgtask worker`` process runs one task and keeps a second waiting for a free slot; the
command then runs as a subprocess on the same database.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

from tests.support.waiting import PATIENCE, wait_until
from tests.support.workerproc import Database, WorkerLauncher, lines, run_cli


def _explain(app_dir: Path, db: Database, task_id: uuid.UUID, *options: str) -> list[str]:
    result = run_cli(
        "task", "explain", str(task_id), *options, "--database-url", db.url, cwd=app_dir
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return lines(result.stdout)


def _error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    [line] = lines(result.stderr)
    return line


def test_help_lists_explain_under_task(app_dir: Path) -> None:
    task = " ".join(run_cli("task", "--help", cwd=app_dir).stdout.split())
    assert "explain" in task
    explain = " ".join(run_cli("task", "explain", "--help", cwd=app_dir).stdout.split())
    for text in ("TASK_ID", "--json", "--database-url", "docs/explain.md"):
        assert text in explain, text


def test_a_task_no_worker_can_run_is_explained_in_plain_words(
    app_dir: Path, db: Database
) -> None:
    [task_id] = db.enqueue("job", None, delay=3600)

    shown = _explain(app_dir, db, task_id)

    assert shown[0] == f"task {task_id} (job v1, queue default): pending"
    assert shown[1].startswith("- it is not due until ")
    assert shown[2] == (
        "- no worker is live; start one with handler 'job' version 1 for queue 'default'"
    )
    assert len(shown) == 3


def test_json_gives_the_codes_and_details_of_a_paused_queue(
    app_dir: Path, db: Database
) -> None:
    [task_id] = db.enqueue("job")
    paused = run_cli("queue", "pause", "default", "--actor", "ann", "--reason", "upgrade",
                     "--database-url", db.url, cwd=app_dir)
    assert paused.returncode == 0, paused.stderr

    [line] = _explain(app_dir, db, task_id, "--json")

    document = json.loads(line)
    assert (document["task_id"], document["state"], document["codes"]) == (
        str(task_id), "pending", ["queue_paused", "no_live_worker"],
    )
    pause = document["reasons"][0]
    assert (pause["code"], pause["actor"], pause["audit_reason"]) == (
        "queue_paused", "ann", "upgrade",
    )
    assert pause["since"] == db.scalar(
        "SELECT paused_at FROM pgtask.queues WHERE name = 'default'"
    ).isoformat()
    assert "is paused since" in pause["message"]


def test_a_running_task_a_busy_worker_and_a_finished_task(
    app_dir: Path, db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start(concurrency=1)
    [running] = db.enqueue("job", {"until": "go"})
    wait_until(lambda: db.state(running) == "running", PATIENCE, message="the claim")
    [queued] = db.enqueue("job", {"until": "go"})

    shown = _explain(app_dir, db, running)
    assert shown[0] == f"task {running} (job v1, queue default): running"
    assert shown[1].startswith(f"- it is running on worker {worker.worker_id} (")
    assert "its lease runs until" in shown[1]

    busy = _explain(app_dir, db, queued)
    assert busy[1] == (
        f"- every live worker able to run it is busy ({worker.worker_id} runs 1 of 1); "
        "it starts when a slot frees"
    )

    workers.release("go")
    wait_until(lambda: db.all_in([running, queued], "succeeded"), PATIENCE, message="both done")
    done = _explain(app_dir, db, running)
    assert done[1].startswith("- it succeeded at ")


def test_an_unknown_task_exits_1_and_a_bad_id_exits_2(app_dir: Path, db: Database) -> None:
    missing = uuid.uuid4()
    unknown = run_cli("task", "explain", str(missing), "--database-url", db.url, cwd=app_dir)
    assert _error(unknown, 1) == f"pgtask: error: no task with id {missing}"

    bad = run_cli("task", "explain", "nope", "--database-url", db.url, cwd=app_dir)
    assert _error(bad, 2) == "pgtask: error: task_id: 'nope' is not a UUID"
