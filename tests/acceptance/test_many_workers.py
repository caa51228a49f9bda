"""Several worker processes on one queue: every task runs to success, and no task is ever run by
two live leases at once (failure model, "Fencing")."""

from __future__ import annotations

import signal

from sqlalchemy_pgtask import EnqueueRequest
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, describe_all

WORKERS = 3
TASKS = 300

#: Per task: its attempts must follow one another. A claim may only start once the previous
#: attempt has finished (released, failed, or recovered as lost after its lease expired).
_OVERLAPPING_ATTEMPTS = """
    SELECT a.task_id, a.attempt AS earlier, b.attempt AS later
    FROM pgtask.attempts a
    JOIN pgtask.attempts b ON b.task_id = a.task_id AND b.attempt = a.attempt + 1
    WHERE a.task_id = ANY(:ids) AND (a.finished_at IS NULL OR b.started_at < a.finished_at)
"""

#: Two handler runs of one task overlapping in time, where the earlier one still held its lease.
_OVERLAPPING_RUNS = """
    SELECT a.task_id, a.attempt AS earlier, b.attempt AS later
    FROM acceptance_runs a
    JOIN acceptance_runs b ON b.task_id = a.task_id AND b.attempt > a.attempt
    JOIN pgtask.attempts earlier ON earlier.task_id = a.task_id AND earlier.attempt = a.attempt
    WHERE b.started_at < coalesce(a.finished_at, 'infinity') AND earlier.state <> 'lost'
"""


def test_three_workers_run_each_of_300_tasks_exactly_once(
    db: Database, workers: WorkerLauncher
) -> None:
    started = [workers.start(concurrency=8) for _ in range(WORKERS)]
    everyone = describe_all(started)
    # A short sleep keeps every worker's slots busy, so all of them compete for claims.
    task_ids = db.enqueue_requests(
        EnqueueRequest(name="job", payload={"sleep": 0.02 * (i % 5), "record": True})
        for i in range(TASKS)
    )

    wait_until(
        lambda: db.all_in(task_ids, "succeeded", "failed", "cancelled"), 90, interval=0.2,
        message=f"{TASKS} tasks to finish", describe=everyone,
    )
    assert db.states(task_ids) == {"succeeded": TASKS}

    # Healthy workers: exactly one claim per task, recorded once, by a worker that ran it.
    attempts = db.rows(
        "SELECT task_id, attempt, state, worker_id FROM pgtask.attempts"
        " WHERE task_id = ANY(:ids)",
        ids=task_ids,
    )
    assert len(attempts) == TASKS
    assert {(a.attempt, a.state) for a in attempts} == {(1, "succeeded")}
    runs = db.rows(
        "SELECT task_id, attempt, worker_id, started_at, finished_at FROM acceptance_runs"
    )
    assert len(runs) == TASKS
    assert {r.task_id for r in runs} == set(task_ids)
    assert all(r.finished_at is not None and r.finished_at >= r.started_at for r in runs)
    claimed_by = {(a.task_id, a.attempt): a.worker_id for a in attempts}
    assert all(claimed_by[(r.task_id, r.attempt)] == r.worker_id for r in runs)

    assert db.rows(_OVERLAPPING_ATTEMPTS, ids=task_ids) == []
    assert db.rows(_OVERLAPPING_RUNS) == []

    # The test only means something if the workers really competed.
    by_worker = {r.worker_id for r in runs}
    assert by_worker <= {w.worker_id for w in started}
    assert len(by_worker) >= 2, "one worker ran every task; nothing was contended"
    assert all(w.alive() for w in started)


def test_tasks_of_a_killed_worker_are_finished_by_the_others_without_overlap(
    db: Database, workers: WorkerLauncher
) -> None:
    started = [workers.start(concurrency=8) for _ in range(WORKERS)]
    victim, *survivors = started
    everyone = describe_all(started)
    task_ids = db.enqueue("job", {"sleep": 0.3, "record": True}, count=150)
    wait_until(
        lambda: db.scalar(
            "SELECT count(*) FROM pgtask.tasks WHERE state = 'running' AND lease_owner = :w",
            w=victim.worker_id,
        ) >= 4,
        20, message="the victim to hold several leases", describe=everyone,
    )
    victim.send(signal.SIGKILL)
    victim.wait_exit(10)

    wait_until(
        lambda: db.all_in(task_ids, "succeeded", "failed", "cancelled"), 60, interval=0.2,
        message="every task to finish", describe=everyone,
    )
    assert db.states(task_ids) == {"succeeded": len(task_ids)}

    lost = db.rows("SELECT task_id, worker_id FROM pgtask.attempts WHERE state = 'lost'")
    assert len(lost) >= 4
    assert {r.worker_id for r in lost} == {victim.worker_id}
    # Every lost task was finished by a survivor, on a later attempt.
    finals = db.rows(
        "SELECT a.task_id, a.attempt, a.worker_id FROM pgtask.attempts a"
        " JOIN pgtask.tasks t ON t.id = a.task_id AND t.attempt = a.attempt"
        " WHERE a.task_id = ANY(:ids)",
        ids=[r.task_id for r in lost],
    )
    assert len(finals) == len(lost)
    assert all(r.attempt >= 2 for r in finals)
    assert {r.worker_id for r in finals} <= {w.worker_id for w in survivors}

    assert db.rows(_OVERLAPPING_ATTEMPTS, ids=task_ids) == []
    assert db.rows(_OVERLAPPING_RUNS) == []
    assert all(w.alive() for w in survivors)
