"""Runtime termination: a worker killed with SIGKILL writes nothing; another worker process
claims the task as a new attempt (failure model, "Process failures"). Here the workers run
without instant rescue (``--no-instant-rescue``, as behind a transaction-pooling proxy), so
the lease is what decides: nobody takes the task before it expires. With instant rescue (the
default) the task comes back at once: ``test_instant_rescue.py``."""

from __future__ import annotations

import signal

from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, describe_all


def test_killed_worker_task_is_reclaimed_by_another_worker_after_lease_expiry(
    db: Database, workers: WorkerLauncher
) -> None:
    first = workers.start("--no-instant-rescue")
    [task_id] = db.enqueue("job", {"sleep_by_attempt": {"1": 120}, "sleep": 0, "record": True})
    wait_until(
        lambda: db.scalar(
            "SELECT count(*) FROM acceptance_runs WHERE task_id = :id AND attempt = 1", id=task_id
        ),
        15, message="attempt 1 to start on the first worker", describe=first.describe,
    )
    second = workers.start("--no-instant-rescue")
    everyone = describe_all([first, second])

    first.send(signal.SIGKILL)
    assert first.wait_exit(10) == -signal.SIGKILL
    # The lease as the dead worker last renewed it: nobody may claim the task before this.
    held = db.row(
        "SELECT state, attempt, lease_owner, lease_expires_at FROM pgtask.tasks WHERE id = :id",
        id=task_id,
    )
    assert held is not None
    assert (held.state, held.attempt, held.lease_owner) == ("running", 1, first.worker_id)

    wait_until(
        lambda: db.state(task_id) == "succeeded", 20,
        message="the task to succeed on the second worker", describe=everyone,
    )
    task = db.task(task_id)
    assert task.attempt == 2
    assert task.result["attempt"] == 2
    assert task.result["pid"] == second.pid

    lost, retried = db.attempts(task_id)
    assert (lost.attempt, lost.state, lost.worker_id) == (1, "lost", first.worker_id)
    assert lost.error == {"type": "lease_expired"}
    assert lost.finished_at >= held.lease_expires_at, "recovered before the lease expired"
    assert (retried.attempt, retried.state, retried.worker_id) == (2, "succeeded", second.worker_id)
    assert retried.started_at >= held.lease_expires_at, "re-claimed before the lease expired"
    assert retried.lease_token != lost.lease_token

    # Attempt 1 never finished (no completion was written for it); attempt 2 ran to the end.
    runs = db.rows(
        "SELECT attempt, pid, finished_at FROM acceptance_runs WHERE task_id = :id"
        " ORDER BY attempt",
        id=task_id,
    )
    assert [(r.attempt, r.pid, r.finished_at is not None) for r in runs] == [
        (1, first.pid, False),
        (2, second.pid, True),
    ]
    assert second.alive()
