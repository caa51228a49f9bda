"""Graceful termination of ``pgtask worker`` by SIGTERM (failure model, "Process failures"):
stop claiming, mark the worker draining, let running handlers finish within the grace period
while their leases are renewed, then hand back what is left; a second signal stops at once.

No test measures how long a shutdown took. Where it matters what ended the process, the other
candidates are made far slower than the deadline: a grace period of `LONG_GRACE`, handlers
that end only when the test releases them, or that outlive the deadline."""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest

from tests.support.waiting import PATIENCE, wait_until
from tests.support.workerproc import (
    LEASE_SECONDS,
    Database,
    WorkerLauncher,
    WorkerProcess,
    lines,
    run_cli,
)

#: A grace period far longer than any deadline here: a worker that exits within `PATIENCE`
#: did not wait it out.
LONG_GRACE = 10 * PATIENCE

#: A handler that sleeps this long outlives every deadline here.
OUTLIVES_THE_TEST = 2 * PATIENCE


def _wait_running(db: Database, worker: WorkerProcess, task_id: object) -> None:
    wait_until(
        lambda: db.scalar(
            "SELECT count(*) FROM pgtask.attempts"
            " WHERE task_id = :id AND state = 'running' AND worker_id = :worker",
            id=task_id, worker=worker.worker_id,
        ),
        PATIENCE, message="the handler to start", describe=worker.describe,
    )


def _draining(db: Database, worker: WorkerProcess) -> bool:
    return bool(
        db.scalar("SELECT draining FROM pgtask.workers WHERE id = :id", id=worker.worker_id)
    )


def test_sigterm_lets_running_handler_finish_and_claims_nothing_new(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start(grace=LONG_GRACE)
    # Both run until the test releases them.
    [running] = db.enqueue("job", {"until": "finish"})
    [renewed] = db.enqueue("job", {"until": "finish"})
    _wait_running(db, worker, running)
    _wait_running(db, worker, renewed)

    worker.send(signal.SIGTERM)
    # Draining is visible while the handlers still run (the grace period).
    wait_until(
        lambda: _draining(db, worker), PATIENCE, interval=0.02,
        message="the worker row to show draining", describe=worker.describe,
    )
    assert db.state(running) == "running", "the first signal must not stop the handler"
    [late] = db.enqueue("job", {"sleep": 0})
    # Longer than two leases while draining: the handler ends on its first attempt only if
    # renewal goes on while the worker drains.
    since = db.scalar("SELECT statement_timestamp()")
    wait_until(
        lambda: db.scalar("SELECT statement_timestamp()") > since + 2 * timedelta(
            seconds=LEASE_SECONDS
        ),
        PATIENCE, message="two lease durations while draining",
    )
    assert db.state(renewed) == "running", worker.describe()
    workers.release("finish")

    # Within PATIENCE, a tenth of the grace period: the drain ended with the handlers.
    assert worker.wait_exit(PATIENCE) == 0, worker.describe()

    for task_id in (running, renewed):
        task = db.task(task_id)
        assert (task.state, task.attempt) == ("succeeded", 1)
        assert [a.state for a in db.attempts(task_id)] == ["succeeded"]

    left = db.task(late)
    assert (left.state, left.attempt) == ("pending", 0), "a task was claimed after SIGTERM"
    assert db.attempts(late) == []

    row = db.row(
        "SELECT draining, expires_at <= statement_timestamp() AS expired"
        " FROM pgtask.workers WHERE id = :id",
        id=worker.worker_id,
    )
    assert row is not None
    assert row.expired, "the worker row is still live after the process exited"
    assert row.draining


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_idle_worker_exits_at_once_on_a_signal(
    db: Database, workers: WorkerLauncher, signum: signal.Signals
) -> None:
    worker = workers.start(grace=LONG_GRACE)
    worker.send(signum)
    # Within PATIENCE, a tenth of the grace period: nothing to drain, so no waiting for it.
    assert worker.wait_exit(PATIENCE) == 0, worker.describe()
    assert db.scalar(
        "SELECT expires_at <= statement_timestamp() FROM pgtask.workers WHERE id = :id",
        id=worker.worker_id,
    )


@pytest.mark.parametrize("handler", ["job", "job-sync"])
def test_handler_longer_than_grace_is_released_back_to_pending(
    db: Database, workers: WorkerLauncher, handler: str
) -> None:
    grace = 1.0
    worker = workers.start(grace=grace)
    [task_id] = db.enqueue(handler, {"sleep": OUTLIVES_THE_TEST})
    _wait_running(db, worker, task_id)

    worker.send(signal.SIGTERM)
    signalled = time.monotonic()
    # The handler would run past PATIENCE: exiting within it, the worker did not wait for it
    # (the synchronous one never looks at its stop request).
    assert worker.wait_exit(PATIENCE) == 0, worker.describe()
    elapsed = time.monotonic() - signalled
    assert elapsed >= grace, "the handler was not given its grace period"

    task = db.task(task_id)
    assert (task.state, task.attempt, task.failed_attempts) == ("pending", 1, 0)
    assert task.lease_token is None
    [attempt] = db.attempts(task_id)
    assert (attempt.state, attempt.worker_id) == ("released", worker.worker_id)
    assert attempt.finished_at is not None


@pytest.mark.parametrize("handler", ["job", "job-sync"])
def test_second_sigterm_releases_running_tasks_at_once(
    db: Database, workers: WorkerLauncher, handler: str
) -> None:
    worker = workers.start(grace=LONG_GRACE)
    [task_id] = db.enqueue(handler, {"sleep": OUTLIVES_THE_TEST})
    _wait_running(db, worker, task_id)

    worker.send(signal.SIGTERM)
    wait_until(
        lambda: _draining(db, worker), PATIENCE, interval=0.02,
        message="the worker row to show draining", describe=worker.describe,
    )
    assert db.state(task_id) == "running", "the first signal must not stop the handler"
    worker.send(signal.SIGTERM)
    # Neither the grace period nor the handler ends within PATIENCE: the second signal did.
    assert worker.wait_exit(PATIENCE) == 0, worker.describe()

    task = db.task(task_id)
    assert (task.state, task.attempt, task.failed_attempts) == ("pending", 1, 0)
    assert [a.state for a in db.attempts(task_id)] == ["released"]


def test_status_shows_a_draining_worker_and_the_work_it_will_not_take(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start(grace=60)
    [running] = db.enqueue("job", {"sleep": 60})
    _wait_running(db, worker, running)
    worker.send(signal.SIGTERM)
    wait_until(
        lambda: _draining(db, worker), PATIENCE, interval=0.02,
        message="the worker row to show draining", describe=worker.describe,
    )
    db.enqueue("job", {"sleep": 0})

    status = run_cli("status", "--database-url", db.url, cwd=workers.directory)
    assert status.returncode == 0, status.stderr
    out = lines(status.stdout)
    assert "live workers: 1" in out
    [listed] = [line for line in out if str(worker.worker_id) in line]
    assert listed.endswith("(draining)")
    assert "  default: 1 pending (1 due), 1 running, 0 waiting" in out
    # A draining worker claims nothing, so its capabilities no longer count.
    assert out[-2:] == ["pending tasks no live worker can run:", "  default job v1: 1"]

    worker.send(signal.SIGTERM)
    assert worker.wait_exit(PATIENCE) == 0, worker.describe()
