"""PostgreSQL connection loss (failure model, "PostgreSQL failures"): a worker whose every
connection is terminated by the server reconnects on its own, idle or mid-task, and the work
still ends in success."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import make_url, text

from sqlalchemy_pgtask.testing import ServerInfo
from tests.support.waiting import PATIENCE, wait_until
from tests.support.workerproc import (
    TEST_APPLICATION,
    Database,
    WorkerLauncher,
    WorkerProcess,
    listener_pids,
    terminate_backends,
)


def _kill_every_connection(db: Database, worker: WorkerProcess) -> None:
    before = wait_until(lambda: listener_pids(db), 10, message="the worker's LISTEN backend")
    killed = terminate_backends(db)
    assert killed >= 1
    # The listener's backend is gone; wait for the worker to LISTEN again on a new one.
    wait_until(
        lambda: listener_pids(db) - before, 15,
        message="the worker to LISTEN again", describe=worker.describe,
    )


def test_idle_worker_reconnects_after_its_connections_are_terminated(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    # Let the pool hold connections too (a claim pass ran, the heartbeat runs).
    db.enqueue("job", {"sleep": 0}, count=2)
    wait_until(
        lambda: db.scalar("SELECT count(*) FROM pgtask.tasks WHERE state = 'succeeded'") == 2,
        15, message="the warm-up tasks", describe=worker.describe,
    )
    killed = terminate_backends(db)
    assert killed >= 2, "expected the worker's pool and listener connections to be killed"
    # Enqueued right after the kill, while the worker is still reconnecting.
    task_ids = db.enqueue("job", {"sleep": 0}, count=5)

    wait_until(
        lambda: db.all_in(task_ids, "succeeded"), 20,
        message="the tasks enqueued after the kill", describe=worker.describe,
    )
    assert worker.alive()
    wait_until(lambda: listener_pids(db), 10, message="the worker to LISTEN again")

    # And again, now that it has reconnected once.
    _kill_every_connection(db, worker)
    more = db.enqueue("job", {"sleep": 0}, count=3)
    wait_until(
        lambda: db.all_in(more, "succeeded"), 20,
        message="the tasks enqueued after the second kill", describe=worker.describe,
    )


def test_running_task_survives_connection_loss_during_renewal_and_outcome(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    # Two leases long: renewals happen while the connections are being killed.
    [task_id] = db.enqueue("job", {"sleep": 3.5})
    wait_until(
        lambda: db.state(task_id) == "running", 15, message="the task to start",
        describe=worker.describe,
    )
    _kill_every_connection(db, worker)
    # Once more, while the handler is still running.
    if db.state(task_id) == "running":
        _kill_every_connection(db, worker)

    wait_until(
        lambda: db.state(task_id) in ("succeeded", "failed", "cancelled"), 30,
        message="the task to finish", describe=worker.describe,
    )
    task = db.task(task_id)
    assert task.state == "succeeded", worker.describe()
    # A lease that could not be renewed in time may have been given up; then a later attempt
    # finished the task. Either way, exactly the last attempt succeeded.
    attempts = db.attempts(task_id)
    assert attempts[-1].state == "succeeded"
    assert attempts[-1].attempt == task.attempt
    assert all(a.state != "running" for a in attempts)
    assert worker.alive()


def test_outcome_written_after_connection_loss_at_completion(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start(concurrency=20)
    # Many short tasks finishing continuously, so outcomes are in flight when the kill lands.
    task_ids = db.enqueue("job", {"sleep": 0.3}, count=60)
    wait_until(
        lambda: db.scalar("SELECT count(*) FROM pgtask.tasks WHERE state = 'succeeded'") >= 10,
        20, message="the first outcomes", describe=worker.describe,
    )
    terminate_backends(db)
    wait_until(
        lambda: db.all_in(task_ids, "succeeded", "failed", "cancelled"), 40, interval=0.1,
        message="every task to finish", describe=worker.describe,
    )
    assert db.states(task_ids) == {"succeeded": len(task_ids)}
    assert db.scalar(
        "SELECT count(*) FROM pgtask.attempts WHERE task_id = ANY(:ids) AND state = 'running'",
        ids=task_ids,
    ) == 0
    assert worker.alive()


def test_outcome_is_written_after_connections_die_as_the_handler_returns(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start()
    # The handler itself terminates the worker's pool and listener connections just before it
    # returns, so the write of its outcome meets a dead connection every time.
    [task_id] = db.enqueue("job", {"sleep": 0.1, "terminate_on_return": True})
    wait_until(
        lambda: db.state(task_id) in ("succeeded", "failed", "cancelled"), 20,
        message="the task to finish", describe=worker.describe,
    )
    task = db.task(task_id)
    assert (task.state, task.attempt, task.failed_attempts) == ("succeeded", 1, 0), (
        worker.describe()
    )
    assert [a.state for a in db.attempts(task_id)] == ["succeeded"]
    # The fault really hit the worker (PostgreSQL's own message for a terminated backend).
    assert "terminating connection due to administrator command" in worker.log()
    assert worker.alive()


def test_handler_is_stopped_before_its_lease_expires_when_renewal_keeps_failing(
    db: Database, workers: WorkerLauncher, pgtask_server: ServerInfo
) -> None:
    worker = workers.start()
    [task_id] = db.enqueue(
        "job", {"sleep_by_attempt": {"1": 6}, "sleep": 0, "record": True, "stop_marker": True}
    )
    wait_until(
        lambda: db.scalar("SELECT count(*) FROM acceptance_runs WHERE task_id = :id", id=task_id),
        15, message="attempt 1 to start", describe=worker.describe,
    )
    name = make_url(db.url).database
    admin = Database(pgtask_server.url)
    marker = workers.directory / f"stopped-{task_id}-1"
    try:
        # An outage until the handler is stopped: the worker can neither renew nor reconnect.
        with db.engine.connect() as held:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            held.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND backend_type = 'client backend' AND application_name <> :test"
                ),
                {"test": TEST_APPLICATION},
            )
            # No renewal can land any more: this is the deadline the handler must beat.
            deadline = held.execute(
                text("SELECT lease_expires_at FROM pgtask.tasks WHERE id = :id"), {"id": task_id}
            ).scalar_one()
            # The deadline only bounds a hang: when it stopped is the marker's, checked below.
            wait_until(
                marker.exists, PATIENCE, message="the worker to stop the handler",
                describe=worker.describe,
            )
            held.rollback()
    finally:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.close()

    stopped_at = datetime.fromtimestamp(float(marker.read_text()), timezone.utc)
    assert stopped_at < deadline, "the handler ran past its lease deadline"

    wait_until(
        lambda: db.state(task_id) == "succeeded", 30, message="the task to succeed afterwards",
        describe=worker.describe,
    )
    first, second = db.attempts(task_id)
    # The worker handed the stopped attempt back once it could write again (released), unless
    # recovery found its lease expired first (lost): either way attempt 2 ran it.
    assert (first.state, second.state) in {("released", "succeeded"), ("lost", "succeeded")}
    # The stopped handler never reached its end; only attempt 2 did.
    runs = db.rows(
        "SELECT attempt, finished_at FROM acceptance_runs WHERE task_id = :id ORDER BY attempt",
        id=task_id,
    )
    assert [(r.attempt, r.finished_at is not None) for r in runs] == [(1, False), (2, True)]
    assert worker.alive()
