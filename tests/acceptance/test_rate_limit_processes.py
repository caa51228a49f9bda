"""A queue's rate limit holds across several worker processes, enforced by the claim itself.

The limit is a token bucket per queue in the database (capacity N, refilled at N per period);
every claim of a governed queue locks the bucket, takes at most its whole tokens and spends
them. So over any stretch of T seconds at most N + N * T / period tasks start, whichever
worker starts them.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy_pgtask import EnqueueRequest
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher, describe_all

LIMIT = 20
PERIOD = 1.0
TASKS = 120


def test_a_rate_limit_of_n_per_second_holds_across_four_worker_processes(
    db: Database, workers: WorkerLauncher
) -> None:
    db.execute(
        "INSERT INTO pgtask.queues (name, rate_limit, rate_period_seconds)"
        " VALUES ('default', :limit, :period)",
        limit=LIMIT, period=PERIOD,
    )
    started = [workers.start(concurrency=8) for _ in range(4)]
    task_ids = db.enqueue_requests(EnqueueRequest(name="job", payload={}) for _ in range(TASKS))
    wait_until(
        lambda: db.all_in(task_ids, "succeeded", "failed", "cancelled"), 90, interval=0.2,
        message=f"{TASKS} rate-limited tasks to finish", describe=describe_all(started),
    )
    assert db.states(task_ids) == {"succeeded": TASKS}

    starts = db.rows(
        "SELECT started_at, worker_id FROM pgtask.attempts WHERE task_id = ANY(:ids)"
        " ORDER BY started_at",
        ids=task_ids,
    )
    assert len(starts) == TASKS
    times = [row.started_at for row in starts]
    # Any one period: at most the bucket's capacity plus one period's refill.
    window = timedelta(seconds=PERIOD)
    for i, first in enumerate(times):
        in_window = sum(1 for t in times[i:] if t < first + window)
        assert in_window <= 2 * LIMIT, f"{in_window} starts within {PERIOD}s of {first}"
    # The whole run: the capacity plus the refill over its length (one period's tolerance).
    span = (times[-1] - times[0]).total_seconds()
    assert LIMIT + LIMIT * span / PERIOD + 1 >= TASKS, f"{TASKS} starts in {span:.2f}s"
    # Several processes really competed for the one limit.
    assert len({row.worker_id for row in starts}) >= 2
