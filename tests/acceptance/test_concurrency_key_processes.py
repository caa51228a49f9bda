"""Concurrency keys (issue 26) across several ``pgtask worker`` processes, enforced by the claim.

The handlers record when each run starts and ends (``acceptance_runs``, the database's clock,
written by the handler itself), so the limit is checked on what actually ran, not only on the
tasks' states.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy_pgtask import EnqueueRequest
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, describe_all

TERMINAL = ("succeeded", "failed", "cancelled")


def _keyed(key: str, limit: int, count: int, payload: dict[str, Any]) -> list[EnqueueRequest]:
    return [
        EnqueueRequest(
            name="job", payload={"record": True, **payload}, concurrency_key=key,
            concurrency_limit=limit,
        )
        for _ in range(count)
    ]


def _runs(db: Database, task_ids: Sequence[uuid.UUID]) -> list[Any]:
    return list(db.rows(
        "SELECT r.task_id, r.started_at, r.finished_at, t.concurrency_key AS key"
        " FROM acceptance_runs AS r JOIN pgtask.tasks AS t ON t.id = r.task_id"
        " WHERE r.task_id = ANY(:ids) ORDER BY r.started_at",
        ids=list(task_ids),
    ))


def _most_overlapping(runs: Sequence[Any]) -> int:
    """The largest number of runs in progress at one moment (an end before a start at a tie)."""
    events = sorted(
        [(r.started_at, 1) for r in runs] + [(r.finished_at, -1) for r in runs],
        key=lambda event: (event[0], event[1]),
    )
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def test_no_key_ever_runs_more_than_its_limit_across_three_worker_processes(
    db: Database, workers: WorkerLauncher
) -> None:
    started = [workers.start(concurrency=4) for _ in range(3)]
    limits = {"pair": 2, "solo-1": 1, "solo-2": 1, "trio": 3}
    requests = [
        request
        for key, limit in limits.items()
        for request in _keyed(key, limit, 8, {"sleep": 0.05})
    ]
    task_ids = db.enqueue_requests(requests)
    wait_until(
        lambda: db.all_in(task_ids, *TERMINAL), 120, interval=0.2,
        message="every keyed task to finish", describe=describe_all(started),
    )
    assert db.states(task_ids) == {"succeeded": len(task_ids)}
    runs = _runs(db, task_ids)
    assert len(runs) == len(task_ids)
    for key, limit in limits.items():
        assert _most_overlapping([r for r in runs if r.key == key]) <= limit, key
    # Several processes really competed for the keys.
    workers_used = db.scalar(
        "SELECT count(DISTINCT worker_id) FROM pgtask.attempts WHERE task_id = ANY(:ids)",
        ids=task_ids,
    )
    assert workers_used >= 2


def test_a_hot_keys_tasks_start_in_order_and_cold_keys_are_not_stalled_behind_it(
    db: Database, workers: WorkerLauncher
) -> None:
    started = [workers.start(concurrency=4) for _ in range(3)]
    hot = db.enqueue_requests(_keyed("hot", 1, 8, {"sleep": 0.3}))
    cold = db.enqueue_requests(
        request for n in range(12) for request in _keyed(f"cold-{n}", 1, 1, {"sleep": 0.05})
    )
    wait_until(
        lambda: db.all_in([*hot, *cold], *TERMINAL), 120, interval=0.2,
        message="the hot and cold tasks to finish", describe=describe_all(started),
    )
    claim_order = [row.id for row in db.rows(
        "SELECT id FROM pgtask.tasks WHERE id = ANY(:ids) ORDER BY priority DESC, run_at, id",
        ids=hot,
    )]
    hot_runs = _runs(db, hot)
    assert [r.task_id for r in hot_runs] == claim_order  # FIFO within the key
    assert _most_overlapping(hot_runs) == 1
    # Every cold task started before the hot key's third task: none waited behind its backlog.
    cold_runs = _runs(db, cold)
    assert len(cold_runs) == len(cold)
    assert max(r.started_at for r in cold_runs) < hot_runs[2].started_at


def test_kill_9_of_a_holder_frees_its_key_through_rescue(
    db: Database, workers: WorkerLauncher
) -> None:
    # The survivor is busy first, so the victim takes the keyed task, and the survivor saw the
    # victim alive (it rescues only a worker it saw holding its lock).
    survivor = workers.start(concurrency=1)
    [blocker] = db.enqueue("job", {"until": "survivor-free"}, count=1)
    wait_until(lambda: db.state(blocker) == "running", 20, message="the survivor to be busy",
               describe=describe_all([survivor]))
    victim = workers.start(concurrency=2)
    everyone = describe_all([victim, survivor])
    [holder] = db.enqueue_requests(_keyed("account-1", 1, 1, {"until": "holder-free"}))
    wait_until(lambda: db.state(holder) == "running", 20, message="the victim to hold the key",
               describe=everyone)
    # The victim has a free slot for it: only the key keeps it from running.
    [waiter] = db.enqueue_requests(_keyed("account-1", 1, 1, {}))
    victim.send(signal.SIGKILL)
    victim.wait_exit(10)
    workers.release("survivor-free")
    wait_until(lambda: db.state(waiter) == "succeeded", 30,
               message="the waiter to run once the holder was rescued", describe=everyone)
    first = db.attempts(holder)[0]
    assert (first.state, first.worker_id) == ("lost", victim.worker_id)
    [waiter_run] = _runs(db, [waiter])
    assert waiter_run.started_at > first.finished_at
    workers.release("holder-free")
    wait_until(lambda: db.state(holder) == "succeeded", 30, message="the holder to finish",
               describe=everyone)
