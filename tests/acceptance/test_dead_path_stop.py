"""Stopping is bounded (issue 23, item 8): with the path to PostgreSQL dead (a proxy that keeps
the connections open and forwards nothing, `tests.support.blackhole`), SIGTERM ends
``pgtask worker --shutdown-grace 10`` within the grace and five seconds more: statements in
flight are severed rather than cancelled (a cancellation waits on the same dead path), the
connections close at once, and what will not close is abandoned.

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
