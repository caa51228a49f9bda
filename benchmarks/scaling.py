"""benchmarks/scaling.py: one, two and four worker processes draining one queue.

One command (run on demand; it is not a test)::

    .venv/bin/python benchmarks/scaling.py [--database-url URL] [--tasks N] [--processes 1,2,4]
                                           [--concurrency C] [--repeat K]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds), installs the schema with the
shipped revisions, and drops it afterwards. For each process count P (default 1, 2 and 4) and
each of ``K`` repeats (default 1) it:

1. pauses the ``default`` queue, enqueues ``N`` no-op tasks (default 30,000) with
   ``enqueue_many`` in batches of 1,000 (one transaction each) and runs ``VACUUM ANALYZE``;
2. starts P ``pgtask worker`` subprocesses (``--concurrency C`` each, default 50), waits until
   every one has written its row in ``pgtask.workers``, and resumes the queue: the resume's
   notification wakes them all at once, so each sees the whole backlog from the start;
3. waits until none is left, then stops the workers with SIGTERM.

Reported per run, and as medians over the repeats:

- **tasks/s** from database times: tasks / (last ``tasks.completed_at`` - first
  ``attempts.started_at``), so process start-up and the enqueue are excluded;
- **worker CPU per task**: user + system CPU of the P worker processes (``/proc/<pid>/stat``)
  from just before the resume commits to the end of the drain, divided by N;
- **PostgreSQL CPU per task**: user + system CPU of the database's backends: every pid that
  ``pg_stat_activity`` lists for the database (sampled every 0.1 s during the run, its last
  reading kept, so a backend that leaves early still counts), except the one that resumed the
  queue and this script's own three; read from ``/proc/<pid>/stat``, which works as root or as
  the server's user when PostgreSQL runs on this host (the figure is 0 otherwise). Autovacuum
  workers on the database count too: they are part of what the drain costs;
- **host busy**: the share of all CPUs that was busy during the drain (``/proc/stat``): a value
  near 100% means the machine, not the worker, sets the pace;
- **drain's share**: the share of all CPUs the drain itself used (worker + PostgreSQL CPU over
  the drain's database time): well below host busy means other jobs took the rest;
- **ceiling**: CPUs x 1 s / (CPU per task), the rate this machine would reach at the measured
  CPU per task if the drain had every core to itself.

A run during which a transaction anywhere on the server held back the cleanup horizon (before
the resume or after the drain) is flagged ``HORIZON HELD``: its figures are not comparable.
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from _server import libpq_url, scratch_database
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import EnqueueRequest, enqueue_many
from sqlalchemy_pgtask.queues import configure_queue

TASKS_MODULE = "scaling_bench_tasks"
TASKS_SOURCE = textwrap.dedent(
    '''
    """Handlers for benchmarks/scaling.py (written to a temporary directory)."""

    from sqlalchemy_pgtask import Registry

    registry = Registry()


    @registry.task("noop")
    async def noop(ctx, payload):
        return None
    '''
)

TICKS = float(os.sysconf("SC_CLK_TCK"))

#: Transactions anywhere on the server that hold back the cleanup horizon (an xid open for
#: more than 2 s, a prepared transaction, a replication slot's xmin): while one lasts, the
#: row versions claims and completions leave behind cannot be pruned and every claim walks
#: them again, so drains slow down (see docs/performance.md, "HORIZON HELD").
HORIZON_SQL = """
SELECT count(*) FROM (
    SELECT 1 FROM pg_stat_activity
    WHERE pid <> pg_backend_pid() AND backend_xid IS NOT NULL
      AND xact_start < now() - interval '2 seconds'
    UNION ALL
    SELECT 1 FROM pg_prepared_xacts WHERE prepared < now() - interval '2 seconds'
    UNION ALL
    SELECT 1 FROM pg_replication_slots WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
) AS holders
"""


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of one process, or None if it is gone or unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs since boot, from ``/proc/stat``."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = float(sum(fields[:8]))
    return total - idle, total


class BackendCpu:
    """CPU used by the database's backends, sampled from ``pg_stat_activity`` pids."""

    def __init__(self, conninfo: str, excluded: set[int]) -> None:
        self.conninfo = conninfo
        self.excluded = excluded
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, conn: psycopg.Connection[Any], baseline: bool) -> None:
        pids = [int(r[0]) for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        ).fetchall()]
        for pid in pids:
            if pid in self.excluded:
                continue
            cpu = process_cpu(pid)
            if cpu is None:
                continue
            # A backend first seen after the start counts from zero (it was new).
            self.first.setdefault(pid, cpu if baseline else 0.0)
            self.last[pid] = cpu

    def start(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            self.excluded.add(int(row[0]))
            self._sample(conn, baseline=True)
        self.thread.start()

    def _run(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            self.excluded.add(int(row[0]))
            while not self.stop.wait(0.1):
                self._sample(conn, baseline=False)
            self._sample(conn, baseline=False)

    def finish(self) -> tuple[float, int]:
        """(CPU seconds, backends seen)."""
        self.stop.set()
        self.thread.join()
        return sum(self.last[p] - self.first[p] for p in self.last), len(self.last)


@contextlib.contextmanager
def workers(url: str, directory: Path, count: int, concurrency: int,
            label: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(directory), os.environ.get("PYTHONPATH")])
    ))
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for index in range(count):
            log = (directory / f"{label}.{index}.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sqlalchemy_pgtask.cli", "worker",
                 f"{TASKS_MODULE}:registry", "--database-url", url,
                 "--concurrency", str(concurrency), "--log-level", "warning"],
                cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def wait_for(conn: psycopg.Connection[Any], sql: str, params: Any, what: str,
             procs: list[subprocess.Popen[bytes]], timeout: float, interval: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(sql, params).fetchone()
        if row is not None and row[0]:
            return
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a worker exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(interval)


def run_once(url: str, conninfo: str, directory: Path, processes: int, args: argparse.Namespace,
             label: str) -> dict[str, float]:
    n = args.tasks
    # The previous run's backends may still be closing: let them go first.
    with psycopg.connect(conninfo, autocommit=True) as conn, contextlib.suppress(RuntimeError):
        wait_for(conn, "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname ="
                 " current_database() AND pid <> pg_backend_pid()", None,
                 "earlier backends to leave", [], 10, 0.05)
    engine = create_engine(url)
    try:
        # Pre-enqueue into a paused queue, so that no worker starts before all are up.
        with Session(engine) as session:
            configure_queue(session, "default", paused=True)
            session.commit()
        for start in range(0, n, 1000):
            with Session(engine) as session:
                enqueue_many(session, [
                    EnqueueRequest(name="noop", payload={"i": i})
                    for i in range(start, min(n, start + 1000))
                ])
                session.commit()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgtask.tasks")
        with psycopg.connect(conninfo, autocommit=True) as conn, workers(
            url, directory, processes, args.concurrency, label
        ) as procs:
            pids = [p.pid for p in procs]
            wait_for(conn, "SELECT count(*) = %s FROM pgtask.workers WHERE pid = ANY(%s)",
                     (processes, pids), f"{processes} workers to register", procs, 120, 0.05)
            holders = int(conn.execute(HORIZON_SQL).fetchone()[0])  # type: ignore[index]
            with Session(engine) as session:
                producer = int(session.connection().exec_driver_sql(
                    "SELECT pg_backend_pid()").scalar_one())
                configure_queue(session, "default", paused=False)
                waiter = int(conn.info.backend_pid)
                backends = BackendCpu(conninfo, {producer, waiter})
                backends.start()
                worker0 = [process_cpu(pid) or 0.0 for pid in pids]
                busy0, total0 = machine_busy()
                session.commit()  # resuming notifies: every worker claims at once
            wait_for(conn, "SELECT NOT EXISTS (SELECT FROM pgtask.tasks"
                     " WHERE state IN ('pending', 'running'))", None,
                     f"{processes} workers to drain {n} tasks", procs, 60 + n / 100, 0.05)
            busy1, total1 = machine_busy()
            holders += int(conn.execute(HORIZON_SQL).fetchone()[0])  # type: ignore[index]
            worker1 = [process_cpu(pid) or 0.0 for pid in pids]
            server_cpu, seen = backends.finish()
    finally:
        engine.dispose()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE state = 'succeeded'),"
            " extract(epoch FROM max(completed_at) - (SELECT min(started_at)"
            " FROM pgtask.attempts)) FROM pgtask.tasks"
        ).fetchone()
        assert row is not None
        succeeded, seconds = int(row[0]), float(row[1])
        conn.execute("TRUNCATE pgtask.tasks CASCADE")
        conn.execute("VACUUM ANALYZE")
    if succeeded != n:
        raise RuntimeError(f"{label}: {succeeded} of {n} tasks succeeded")
    worker_cpu = sum(worker1) - sum(worker0)
    cores = os.cpu_count() or 1
    return {
        "tasks_per_s": n / seconds,
        "seconds": seconds,
        "worker_us": worker_cpu / n * 1e6,
        "server_us": server_cpu / n * 1e6,
        "total_us": (worker_cpu + server_cpu) / n * 1e6,
        "host_busy_pct": 100.0 * (busy1 - busy0) / max(1.0, total1 - total0),
        # The share of the machine the drain itself used (workers + their backends), and the
        # rate the machine could reach at this CPU per task if nothing else ran on it.
        "share_pct": 100.0 * (worker_cpu + server_cpu) / (seconds * cores),
        "ceiling": cores * n / max(1e-9, worker_cpu + server_cpu),
        "backends": float(seen),
        "horizon_held": float(holders > 0),
    }


COLUMNS = (("tasks_per_s", "tasks/s", "{:,.0f}"), ("worker_us", "worker us/task", "{:.0f}"),
           ("server_us", "postgres us/task", "{:.0f}"), ("total_us", "total us/task", "{:.0f}"),
           ("host_busy_pct", "host busy %", "{:.0f}"), ("share_pct", "drain's share %", "{:.0f}"),
           ("ceiling", "ceiling tasks/s", "{:,.0f}"), ("backends", "backends", "{:.0f}"))


def line(label: str, figures: dict[str, float]) -> str:
    text = label + "  " + "  ".join(
        f"{title} {fmt.format(figures[key])}" for key, title, fmt in COLUMNS
    )
    if figures.get("horizon_held"):
        text += "  HORIZON HELD (a long transaction on the server: figures not comparable)"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    parser.add_argument("--tasks", type=int, default=30_000)
    parser.add_argument("--processes", default="1,2,4",
                        help="comma-separated worker process counts (default: 1,2,4)")
    parser.add_argument("--concurrency", type=int, default=50, help="per worker process")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    counts = [int(x) for x in args.processes.split(",")]
    # SIGTERM unwinds like Ctrl-C: the workers are stopped and the database dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database(args.database_url, "pgtask_bench_scaling"))
        conninfo = libpq_url(url)
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (directory / f"{TASKS_MODULE}.py").write_text(TASKS_SOURCE)
        print(f"{args.tasks:,} no-op tasks, --concurrency {args.concurrency} per process, "
              f"{os.cpu_count()} CPUs", flush=True)
        results: dict[int, list[dict[str, float]]] = {p: [] for p in counts}
        for repeat in range(1, args.repeat + 1):
            for processes in counts:
                label = f"p{processes}.r{repeat}"
                figures = run_once(url, conninfo, directory, processes, args, label)
                results[processes].append(figures)
                print(line(f"repeat {repeat}, {processes} process(es):", figures), flush=True)
        print(f"medians over {args.repeat} repeat(s):")
        for processes in counts:
            runs = results[processes]
            median = {key: statistics.median(r[key] for r in runs) for key, _, _ in COLUMNS}
            print(line(f"  {processes} process(es):", median))
    return 0


if __name__ == "__main__":
    sys.exit(main())
