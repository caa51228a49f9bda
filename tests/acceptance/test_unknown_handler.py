"""Unknown handler (failure model, "Process failures"): a worker claims only the names and
versions it registered; other tasks stay pending, untouched, and ``pgtask status`` shows them
as work no live worker can run."""

from __future__ import annotations

from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, lines, run_cli


def test_unregistered_tasks_stay_pending_and_status_reports_them(
    db: Database, workers: WorkerLauncher
) -> None:
    # Enqueued before the worker starts, so every claim pass it makes has seen them due.
    [newer_version] = db.enqueue("job", {"sleep": 0}, version=2)
    [unknown_name] = db.enqueue("no-such-handler", {}, count=1)
    worker = workers.start()
    known = db.enqueue("job", {"sleep": 0}, count=5)
    wait_until(
        lambda: db.all_in(known, "succeeded"), 15, message="the registered tasks",
        describe=worker.describe,
    )

    for task_id in (newer_version, unknown_name):
        task = db.task(task_id)
        assert (task.state, task.attempt, task.lease_owner) == ("pending", 0, None)
        assert db.attempts(task_id) == []

    result = run_cli("status", "--database-url", db.url, cwd=workers.directory)
    assert result.returncode == 0, result.stderr
    out = lines(result.stdout)
    assert "live workers: 1" in out
    assert any(str(worker.worker_id) in line and f"pid {worker.pid}" in line for line in out)
    stuck = out.index("pending tasks no live worker can run:")
    assert sorted(out[stuck + 1:]) == sorted([
        "  default job v2: 1",
        "  default no-such-handler v1: 1",
    ])
    assert worker.alive()
