"""Database time (failure model, "Database clock movement"): claims, leases and delays use
PostgreSQL's clock, never the worker's. A worker process whose wall clock is hours off (via
libfaketime) still waits for ``run_at`` and keeps its leases."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.support.waiting import PATIENCE, SLOW_POLL, wait_until
from tests.support.workerproc import Database, WorkerLauncher, cli_env

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
DELAY = 2.0


def _hours(offset: str) -> int:
    return int(offset.removesuffix("h"))


def _faked_env(offset: str) -> dict[str, str]:
    if not LIBFAKETIME.exists():
        pytest.skip(f"libfaketime is not installed ({LIBFAKETIME}; apt-get install faketime)")
    preload = " ".join(p for p in (str(LIBFAKETIME), os.environ.get("LD_PRELOAD", "")) if p)
    env = {"LD_PRELOAD": preload, "FAKETIME": offset, "DONT_FAKE_MONOTONIC": "1"}
    # Prove the fake clock takes effect in a Python child before trusting it in a worker.
    seen = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        env=cli_env(env), capture_output=True, text=True, timeout=30, check=True,
    )
    skew = float(seen.stdout) - datetime.now(timezone.utc).timestamp()
    if abs(skew - _hours(offset) * 3600) > 600:
        pytest.skip(f"libfaketime did not shift the clock by {offset} (skew {skew:.0f} s)")
    return env


@pytest.mark.parametrize("offset", ["+5h", "-5h"])
def test_worker_with_skewed_clock_respects_run_at_and_keeps_leases(
    db: Database, workers: WorkerLauncher, offset: str
) -> None:
    # A poll interval far beyond the deadline: the delayed task runs in time only if the worker
    # computes its sleep from database time (a -5h clock would otherwise sleep for hours, +5h
    # not at all). The delay is real: the worker's own timer is what is tested, and moving the
    # database clock would also expire the long task's lease.
    worker = workers.start(poll=SLOW_POLL, env=_faked_env(offset))
    [delayed] = db.enqueue("job", {"sleep": 0}, delay=DELAY)
    # More than two leases long: it keeps attempt 1 only if renewals use database time.
    [long] = db.enqueue("job", {"sleep": 4.0})

    wait_until(
        lambda: db.all_in([delayed, long], "succeeded", "failed", "cancelled"), PATIENCE,
        message="both tasks to finish", describe=worker.describe,
    )
    for task_id in (delayed, long):
        task = db.task(task_id)
        assert (task.state, task.attempt) == ("succeeded", 1), worker.describe()
        assert [a.state for a in db.attempts(task_id)] == ["succeeded"]

    task = db.task(delayed)
    [attempt] = db.attempts(delayed)
    assert (task.run_at - task.created_at).total_seconds() == pytest.approx(DELAY, abs=0.01)
    assert attempt.started_at >= task.run_at, "claimed before its run_at in database time"
    # On time, by the database's clock: not early (above), and sooner than the poll would have
    # run it (which the deadline, a tenth of the poll interval, already made sure of).
    assert (attempt.started_at - task.run_at).total_seconds() < SLOW_POLL
    assert worker.alive()
    # The worker really ran with the skewed clock: its log timestamps are hours off.
    stamp = datetime.strptime(worker.log()[:19], "%Y-%m-%d %H:%M:%S")
    skew = (stamp - datetime.now()).total_seconds()
    assert skew == pytest.approx(_hours(offset) * 3600, abs=600)
