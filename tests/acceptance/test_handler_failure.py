"""A failing handler (failure model, "Panic in a handler"): its attempt records a structured
failure and the retry policy applies; the worker process and unrelated handlers go on."""

from __future__ import annotations

import pytest

from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher


@pytest.mark.parametrize("handler", ["job", "job-sync"])
def test_failing_handlers_are_recorded_and_do_not_disturb_others(
    db: Database, workers: WorkerLauncher, handler: str
) -> None:
    worker = workers.start()
    [unrelated] = db.enqueue(handler, {"sleep": 2.0})
    failing = {
        kind: db.enqueue(handler, {"sleep": 0.1, "fail": kind}, max_attempts=2)[0]
        for kind in ("error", "exit", "interrupt")
    }
    everything = [unrelated, *failing.values()]
    wait_until(
        lambda: db.all_in(everything, "succeeded", "failed", "cancelled"), 20,
        message="every task to finish", describe=worker.describe,
    )
    assert worker.alive(), worker.describe()

    task = db.task(unrelated)
    assert (task.state, task.attempt) == ("succeeded", 1)
    exceptions = {"error": "RuntimeError", "exit": "SystemExit", "interrupt": "KeyboardInterrupt"}
    for kind, task_id in failing.items():
        task = db.task(task_id)
        # Retried once by the handler's policy, then failed for good (max_attempts=2).
        assert (task.state, task.attempt, task.failed_attempts) == ("failed", 2, 2), kind
        assert task.error["type"] == "handler_error"
        assert task.error["exception"] == exceptions[kind]
        assert "traceback" in task.error
        attempts = db.attempts(task_id)
        assert [a.state for a in attempts] == ["failed", "failed"]
        assert all(a.error["exception"] == exceptions[kind] for a in attempts)
        # The retry waited for the policy's delay (0.2 s, database time).
        assert (attempts[1].started_at - attempts[0].finished_at).total_seconds() >= 0.19

    # Still serving: a new task runs after all of that.
    [later] = db.enqueue(handler, {"sleep": 0})
    wait_until(lambda: db.state(later) == "succeeded", 10, describe=worker.describe)
