"""Instant rescue versus a live worker's connection loss (failure model, "Connection loss while
idle": the loops reconnect, and in-memory handler work continues).

A worker whose every connection the server ended is alive: it reconnects and takes its lock
again. Another worker's rescue pass must not take its running task meanwhile.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from sqlalchemy import make_url, text

from sqlalchemy_pgtask.statements.rescue import LOCK_NAMESPACE
from sqlalchemy_pgtask.testing import ServerInfo
from tests.support.waiting import wait_until
from tests.support.workerproc import (
    TEST_APPLICATION,
    Database,
    WorkerLauncher,
    WorkerProcess,
    describe_all,
    terminate_backends,
)

LEASE = 30.0


def _running_on(db: Database, task_id: object, worker: WorkerProcess) -> bool:
    return bool(db.scalar(
        "SELECT count(*) FROM pgtask.tasks WHERE id = :id AND state = 'running'"
        " AND lease_owner = :w",
        id=task_id, w=worker.worker_id,
    ))


def _holders(db: Database, worker: WorkerProcess) -> str:
    """A ``terminate_backends`` filter: the backends holding ``worker``'s advisory lock."""
    key = db.scalar("SELECT lock_key FROM pgtask.workers WHERE id = :w", w=worker.worker_id)
    assert key is not None
    return (
        "pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'"
        f" AND classid = {int(LOCK_NAMESPACE)} AND objid = {int(key)} AND objsubid = 2)"
    )


def _kept_and_finished(
    db: Database, workers: WorkerLauncher, task_id: uuid.UUID, victim: WorkerProcess,
    everyone: Callable[[], str],
) -> None:
    """Several rescue passes later the victim still runs the task, and finishes it in one
    attempt: no rescuer took it."""
    time.sleep(2.0)  # a stretch in which nothing may happen: there is no event to wait for
    assert _running_on(db, task_id, victim), everyone()
    workers.release("done")
    workers.release("rescuer-free")
    wait_until(lambda: db.state(task_id) == "succeeded", 20, message="the task to finish",
               describe=everyone)
    assert [(a.state, a.worker_id) for a in db.attempts(task_id)] == [
        ("succeeded", victim.worker_id)
    ]


def _start_pair(
    db: Database, workers: WorkerLauncher
) -> tuple[WorkerProcess, uuid.UUID, Callable[[], str]]:
    """A rescuer that knows the victim alive, and the victim running a task of its own: the
    victim, its task, and a description of both workers for failure messages."""
    rescuer = workers.start(lease=LEASE, concurrency=1)
    [blocker] = db.enqueue("job", {"until": "rescuer-free"}, count=1)
    wait_until(lambda: _running_on(db, blocker, rescuer), 20,
               message="the rescuer to be busy", describe=describe_all([rescuer]))
    victim = workers.start(lease=LEASE, concurrency=1)
    everyone = describe_all([rescuer, victim])
    [task_id] = db.enqueue("job", {"until": "done"}, count=1)
    wait_until(lambda: _running_on(db, task_id, victim), 20,
               message="the victim to run the task", describe=everyone)
    return victim, task_id, everyone


def test_a_worker_whose_connections_were_all_terminated_keeps_its_running_task(
    db: Database, workers: WorkerLauncher
) -> None:
    victim, task_id, everyone = _start_pair(db, workers)
    holders = _holders(db, victim)
    assert terminate_backends(db, holders) >= 2
    # Back within moments, holding its lock on new connections.
    wait_until(lambda: db.scalar(f"SELECT count(*) FROM pg_stat_activity WHERE {holders}"),
               20, message="the victim to take its lock again", describe=everyone)
    _kept_and_finished(db, workers, task_id, victim, everyone)


def test_a_worker_that_cannot_reconnect_for_a_moment_keeps_its_running_task(
    db: Database, workers: WorkerLauncher, pgtask_server: ServerInfo
) -> None:
    # Every connection of the victim ended, and for three seconds the server refuses new
    # ones (as when it is at max_connections): the rescuer's own session lives on. Three
    # seconds is longer than the two within which a killed worker's task runs again, so no
    # waiting time could tell the two apart: how the sessions ended does.
    victim, task_id, everyone = _start_pair(db, workers)
    name = make_url(db.url).database
    holders = _holders(db, victim)
    admin = Database(pgtask_server.url)
    try:
        with db.engine.connect() as held:  # opened before: the test's own view lives on
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            held.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE {holders} AND application_name <> :test"
            ), {"test": TEST_APPLICATION})
            time.sleep(3.0)
            held.rollback()
    finally:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.close()
    _kept_and_finished(db, workers, task_id, victim, everyone)
