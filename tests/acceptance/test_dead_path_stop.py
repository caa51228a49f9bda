"""Stopping is bounded (issue 23, item 8): with the path to PostgreSQL dead (a proxy that keeps
the connections open and forwards nothing, `tests.support.blackhole`), SIGTERM ends
``pgtask worker --shutdown-grace 10`` within the grace and five seconds more: statements in
flight are severed rather than cancelled (a cancellation waits on the same dead path), the
connections close at once, and what will not close is abandoned.

With ``--on-stuck-handler exit``, a ``def`` handler that sleeps on after its stop request when
its lease can expire ends the process with status 75, and a peer runs the task again (issue
23, item 4).

The bound asserted is the promise itself (grace + 5 s); the measured figures are in
``benchmarks/dead_path.py`` and ``docs/performance.md``.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.blackhole import black_hole_proxy
from tests.support.waiting import PATIENCE, wait_until
from tests.support.workerproc import Database, WorkerLauncher

GRACE = 10.0


@pytest.mark.parametrize("handler", ["job", "job-sync"])
def test_sigterm_with_a_dead_path_exits_within_the_grace_and_five_seconds(
    db: Database, workers: WorkerLauncher, handler: str
) -> None:
    with black_hole_proxy(db.url) as proxy:
        worker = workers.start("--database-url", proxy.url(db.url), grace=GRACE, poll=0.1,
                               lease=30.0)
        [task_id] = db.enqueue(handler, {"sleep": 10 * PATIENCE})
        wait_until(lambda: db.state(task_id) == "running", PATIENCE, describe=worker.describe)
        proxy.black_hole()
        # Statements are in flight in the hole (claims every 0.1 s, renewals) when the
        # signal comes.
        swallowed = proxy.swallowed
        wait_until(lambda: proxy.swallowed >= swallowed + 3, PATIENCE, describe=worker.describe)
        worker.send(signal.SIGTERM)
        signalled = time.monotonic()
        code = worker.wait_exit(PATIENCE)
        elapsed = time.monotonic() - signalled
        assert code == 0, worker.describe()
        assert elapsed <= GRACE + 5.0, f"stopped after {elapsed:.1f} s\n{worker.describe()}"


def test_on_stuck_handler_exit_ends_the_worker_with_75_and_a_peer_runs_the_task_again(
    db: Database, workers: WorkerLauncher
) -> None:
    with black_hole_proxy(db.url) as proxy:
        stuck = workers.start("--database-url", proxy.url(db.url), "--on-stuck-handler", "exit",
                              "--queue", "default")
        [task_id] = db.enqueue("job-sync", {"sleep_by_attempt": {"1": 10 * PATIENCE}})
        wait_until(lambda: db.state(task_id) == "running", PATIENCE, describe=stuck.describe)
        peer = workers.start()  # a direct path: it rescues what the stuck worker held
        proxy.black_hole()  # no renewal: the watchdog asks the handler to stop; it sleeps on
        assert stuck.wait_exit(PATIENCE) == 75, stuck.describe()
        assert "(--on-stuck-handler exit)" in stuck.log()

        def second_attempt() -> bool:
            attempts = db.attempts(task_id)
            return len(attempts) >= 2 and attempts[-1].worker_id == peer.worker_id

        wait_until(second_attempt, PATIENCE, describe=peer.describe)
