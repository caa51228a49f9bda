"""benchmarks/rescue.py: ``kill -9`` of a worker to its task running again elsewhere.

One command (run on demand; it is not a test)::

    .venv/bin/python benchmarks/rescue.py [--database-url URL] [--rounds N] [--lease S]
                                          [--no-instant-rescue]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds), installs the schema, and runs
two ``pgtask worker`` subprocesses with a ``--lease`` of 30 s (concurrency 1 each). Each round
enqueues one task that blocks until released, waits for a worker to run it, kills that worker
with SIGKILL, and measures in database time from just before the kill to the start of the
task's next attempt on the other worker; then it releases the task and starts a fresh worker
in place of the killed one (a rescuer only acts for workers it knew alive during its own
session, and a worker looks at the others before it registers). It prints every round and the
median and maximum. With ``--no-instant-rescue`` the workers run without it, for comparison
(the lease expiry decides).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psycopg
from _server import libpq_url, scratch_database

TASKS_SOURCE = textwrap.dedent(
    '''
    """Handlers for benchmarks/rescue.py (written to a temporary directory)."""
    import asyncio
    from pathlib import Path

    from sqlalchemy_pgtask import Registry

    registry = Registry()

    @registry.task("block")
    async def block(ctx, payload):
        while not Path(payload["until"]).exists():
            await asyncio.sleep(0.02)
    '''
)


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()


def one(conninfo: str, sql: str, params: Any = None) -> Any:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]


def wait_for(conninfo: str, sql: str, params: Any, what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = one(conninfo, sql, params)
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(what)


def start_worker(url: str, directory: Path, lease: float, instant: bool) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(directory)}
    command = [
        sys.executable, "-m", "sqlalchemy_pgtask.cli", "worker", "rescue_bench_tasks:registry",
        "--database-url", url, "--concurrency", "1", "--lease-duration", str(lease),
        "--log-level", os.environ.get("RESCUE_BENCH_LOG_LEVEL", "warning"),
    ]
    if not instant:
        command.append("--no-instant-rescue")
    log = open(os.environ.get("RESCUE_BENCH_LOG", os.devnull), "ab")  # noqa: SIM115
    return subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--no-instant-rescue", action="store_true")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database(args.database_url, "pgtask_bench_rescue"))
        conninfo = libpq_url(url)
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (directory / "rescue_bench_tasks.py").write_text(TASKS_SOURCE)
        instant = not args.no_instant_rescue
        procs = [start_worker(url, directory, args.lease, instant) for _ in range(2)]
        # Whichever workers are left at the end (the list is replaced as workers are killed).
        stack.callback(lambda: kill_all(procs))
        wait_for(conninfo, "SELECT count(*) = 2 FROM pgtask.workers WHERE expires_at > now()",
                 None, "two live workers")
        results = []
        for round_number in range(1, args.rounds + 1):
            marker = directory / f"release-{round_number}"
            task_id = one(
                conninfo,
                "INSERT INTO pgtask.tasks (queue, name, payload) VALUES ('default', 'block',"
                " jsonb_build_object('until', %s::text)) RETURNING id",
                (str(marker),),
            )
            owner = wait_for(conninfo, "SELECT lease_owner FROM pgtask.tasks WHERE id = %s"
                             " AND state = 'running'", (task_id,), "the first claim")
            pid = one(conninfo, "SELECT pid FROM pgtask.workers WHERE id = %s", (owner,))
            killed_at = one(conninfo, "SELECT statement_timestamp()")
            os.kill(pid, signal.SIGKILL)
            started = wait_for(
                conninfo, "SELECT started_at FROM pgtask.attempts WHERE task_id = %s"
                " AND attempt = 2", (task_id,), "the second attempt", timeout=args.lease * 3,
            )
            seconds = (started - killed_at).total_seconds()
            results.append(seconds)
            print(f"round {round_number}: restarted {seconds:.3f} s after kill -9")
            marker.touch()
            procs = [p for p in procs if p.poll() is None]
            fresh = start_worker(url, directory, args.lease, instant)
            procs.append(fresh)
            # Registered, it has seen the other one alive (a worker looks before it registers).
            wait_for(conninfo, "SELECT count(*) = 1 FROM pgtask.workers WHERE pid = %s",
                     (fresh.pid,), "the fresh worker to register")
        print(f"median {statistics.median(results):.3f} s, max {max(results):.3f} s"
              f" (lease {args.lease:g} s, instant rescue {'on' if instant else 'off'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
