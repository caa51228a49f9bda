"""Instant rescue with real processes: ``kill -9`` of a worker hands its task to another
worker within a second or two, long before its 30-second lease would expire; a worker that
only lost one connection keeps its task.
"""

from __future__ import annotations

import signal
from datetime import timedelta

from sqlalchemy_pgtask.statements.rescue import RESCUE
from tests.support.waiting import wait_until
from tests.support.workerproc import (
    Database,
    WorkerLauncher,
    describe_all,
    listener_pids,
    terminate_backends,
)

LEASE = 30.0


def rescuable(db: Database) -> list[object]:
    """What a rescue pass would take back now (rolled back: it only looks)."""
    owners = [row.id for row in db.rows("SELECT id FROM pgtask.workers")]
    with db.engine.connect() as conn:
        return [row.id for row in conn.execute(RESCUE, {"owners": owners, "limit": 100})]


def _running_on(db: Database, task_id: object, worker_id: object) -> bool:
    return bool(db.scalar(
        "SELECT count(*) FROM pgtask.tasks WHERE id = :id AND state = 'running'"
        " AND lease_owner = :w",
        id=task_id, w=worker_id,
    ))


def test_a_killed_workers_task_restarts_long_before_its_lease_expires(
    db: Database, workers: WorkerLauncher
) -> None:
    # The survivor runs first (busy with a blocker, so the victim gets the task): the victim
    # registers while the survivor looks on, so the survivor knows it was alive.
    survivor = workers.start(lease=LEASE, concurrency=1)
    [blocker] = db.enqueue("job", {"until": "survivor-free"}, count=1)
    wait_until(lambda: _running_on(db, blocker, survivor.worker_id), 20,
               message="the survivor to be busy", describe=describe_all([survivor]))
    victim = workers.start(lease=LEASE, concurrency=1)
    everyone = describe_all([victim, survivor])
    [task_id] = db.enqueue("job", {"until": "rescued"}, count=1)
    wait_until(lambda: _running_on(db, task_id, victim.worker_id), 20,
               message="the victim to run the task", describe=everyone)
    expiry = db.scalar("SELECT lease_expires_at FROM pgtask.tasks WHERE id = :id", id=task_id)
    victim.send(signal.SIGKILL)
    victim.wait_exit(10)

    wait_until(lambda: db.state(task_id) == "pending", LEASE / 2,
               message="the survivor to rescue the task", describe=everyone)
    workers.release("survivor-free")
    workers.release("rescued")
    wait_until(lambda: db.state(task_id) == "succeeded", 20, message="the task to finish",
               describe=everyone)
    first, second = db.attempts(task_id)
    assert (first.state, first.worker_id) == ("lost", victim.worker_id)
    assert first.error == {"type": "lease_expired", "reason": "worker_gone"}
    # Database time: taken back well within the lease, not at its expiry.
    assert first.finished_at < expiry - timedelta(seconds=LEASE / 2)
    assert (second.state, second.worker_id) == ("succeeded", survivor.worker_id)


def test_a_worker_that_lost_one_connection_keeps_its_task(
    db: Database, workers: WorkerLauncher
) -> None:
    worker = workers.start(lease=LEASE, concurrency=1)
    describe = describe_all([worker])
    [task_id] = db.enqueue("job", {"until": "done"}, count=1)
    wait_until(lambda: _running_on(db, task_id, worker.worker_id), 20,
               message="the worker to run the task", describe=describe)
    before = listener_pids(db)
    assert terminate_backends(db, "query = 'LISTEN pgtask_ready'") == 1
    # Its other connections still hold the lock: nothing to rescue, now or once it is back.
    assert rescuable(db) == []
    wait_until(lambda: listener_pids(db) - before, 20, message="the listener to reconnect",
               describe=describe)
    assert rescuable(db) == []
    workers.release("done")
    wait_until(lambda: db.state(task_id) == "succeeded", 20, message="the task to finish",
               describe=describe)
    assert [a.state for a in db.attempts(task_id)] == ["succeeded"]
    assert worker.alive()

