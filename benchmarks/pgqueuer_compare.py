"""benchmarks/pgqueuer_compare.py: PgQueuer and this library side by side on the same host:
enqueues, enqueue-to-start latency and drains at concurrency 10 and 100, alternated.

::

    python3 -m venv /tmp/pgq && /tmp/pgq/bin/pip install "pgqueuer==1.6.0" asyncpg uvloop
    .venv/bin/python benchmarks/pgqueuer_compare.py --pgqueuer-python /tmp/pgq/bin/python \\
        [--database-url URL] [--rounds 3] [--only enqueue_single,enqueue_many,latency,...]

The performance issue's figures for PgQueuer (the fastest Python peer on PostgreSQL: asyncpg,
no fencing, no attempt history) come from another host, and this host's figures swing with
its load, so the peer is measured here, in turn with ``run.py``. PgQueuer runs in its own
interpreter (``--pgqueuer-python``: it is no dependency of this project), a fresh database per
measurement, its worker a ``QueueManager`` on asyncpg and uvloop:

* ``enqueue_single``, ``enqueue_many``: 2,000 jobs one ``enqueue`` call each (an autocommit
  ``INSERT``: PgQueuer enqueues outside any transaction of the caller), and 20,000 in calls
  of 1,000 (one statement each), after 20 to warm up; tasks/s of the loop. Ours: ``run.py
  --only enqueue_single`` (``BEGIN``, the insert, ``COMMIT``: inside the caller's
  transaction) / ``enqueue_many``.
* ``latency``: as ``run.py``'s ``latency``: a worker with ``batch_size=10`` (our concurrency
  10) idle for a second, a producer that enqueues one job every 20 ms on its own connection
  (an autocommit ``INSERT``); 20 warm-up jobs, then 200 timed from the producer's commit to
  the handler's start. Ours: ``run.py --only latency``.
* ``drain_c10``, ``drain_c100``: 20,000 jobs enqueued in batches of 1,000, then one worker
  with ``batch_size`` 10 or 100 (PgQueuer's concurrency knob: the jobs it fetches per
  dequeue; running jobs are not capped) and a no-op ``async`` handler drains them; tasks/s
  from the first handler start to the transaction time of the last acknowledgement (its
  ``pgqueuer_log`` row). Ours: ``run.py --only drain_c10_async`` / ``drain_c100_async``
  (first attempt start to last completion, in database time).

It prints each measurement as it goes, then the medians over the rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from _server import libpq_url, psycopg_url, server

from sqlalchemy_pgtask.testing import create_database, drop_database

WARMUP, TIMED, GAP = 20, 200, 0.020
DRAIN = 20_000

#: Run by ``--pgqueuer-python`` as ``MODE DSN ...``: ``install``; ``fill N``; ``enqueue N
#: BATCH`` (prints the enqueue's tasks/s, each call its own autocommit statement); ``worker OUT
#: READY TOTAL BATCH`` (handler start times to OUT once TOTAL jobs ran, READY once running);
#: ``produce OUT TOTAL GAP`` (commit times to OUT). Wall-clock times (``time.time``): the
#: worker and the producer are two processes.
PGQUEUER_SIDE = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from datetime import timedelta

    import asyncpg, uvloop
    from pgqueuer import Queries, QueueManager
    from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver

    async def queries(dsn):
        return Queries(AsyncpgDriver(await asyncpg.connect(dsn)))

    async def install(dsn):
        await (await queries(dsn)).install()

    async def fill(dsn, count, batch=1000):
        q = await queries(dsn)
        for first in range(0, count, batch):
            n = min(batch, count - first)
            if n == 1:
                await q.enqueue("noop", str(first).encode())
            else:
                await q.enqueue(["noop"] * n, [str(first + i).encode() for i in range(n)], [0] * n)

    async def timed_fill(dsn, count, batch):
        await fill(dsn, 20, min(batch, 20))  # warm the statements, as run.py does
        start = time.perf_counter()
        await fill(dsn, count, batch)
        print(json.dumps({"tasks_per_s": count / (time.perf_counter() - start)}))

    async def worker(dsn, out, ready, total, batch):
        qm = QueueManager(await queries(dsn))
        starts = {}

        @qm.entrypoint("noop")
        async def noop(job):
            starts[job.payload.decode()] = time.time()
            if len(starts) == total:
                with open(out, "w") as f:
                    json.dump(starts, f)
                qm.shutdown.set()

        asyncio.get_running_loop().call_later(0.5, lambda: open(ready, "w").close())
        await qm.run(batch_size=batch, dequeue_timeout=timedelta(seconds=30))

    async def produce(dsn, out, total, gap):
        q = await queries(dsn)
        committed = {}
        next_at = time.monotonic()
        for i in range(total):
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            next_at += gap
            await q.enqueue("noop", str(i).encode())  # autocommit: one INSERT
            committed[str(i)] = time.time()
        with open(out, "w") as f:
            json.dump(committed, f)

    mode, dsn, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "install":
        uvloop.run(install(dsn))
    elif mode == "fill":
        uvloop.run(fill(dsn, int(rest[0])))
    elif mode == "enqueue":
        uvloop.run(timed_fill(dsn, int(rest[0]), int(rest[1])))
    elif mode == "worker":
        uvloop.run(worker(dsn, rest[0], rest[1], int(rest[2]), int(rest[3])))
    else:
        uvloop.run(produce(dsn, rest[0], int(rest[1]), float(rest[2])))
    """
)


class PgQueuer:
    """One PgQueuer measurement: a fresh database with its schema, and its processes."""

    def __init__(self, python: str, server_url: str, tmp: Path) -> None:
        self.side = [python, "-c", PGQUEUER_SIDE]
        self.server_url = server_url
        self.tmp = tmp
        self.starts, self.ready = tmp / "starts.json", tmp / "ready"

    def run(self, measure: Callable[[str], dict[str, float]]) -> dict[str, float]:
        raw = create_database(self.server_url, "pgqueuer_compare")
        try:
            dsn = libpq_url(raw)
            subprocess.run([*self.side, "install", dsn], check=True, capture_output=True)
            return measure(dsn)
        finally:
            drop_database(raw)

    def start_worker(self, dsn: str, total: int, batch: int) -> subprocess.Popen[bytes]:
        for path in (self.starts, self.ready):
            path.unlink(missing_ok=True)
        return subprocess.Popen(
            [*self.side, "worker", dsn, str(self.starts), str(self.ready), str(total),
             str(batch)],
            stdout=subprocess.DEVNULL,
        )

    def latency(self, dsn: str) -> dict[str, float]:
        total = WARMUP + TIMED
        committed = self.tmp / "committed.json"
        worker = self.start_worker(dsn, total, 10)
        try:
            wait_until(self.ready.exists, worker, 60, "the worker to start")
            time.sleep(1.0)  # its first dequeue has run and it is asleep, as in run.py
            subprocess.run(
                [*self.side, "produce", dsn, str(committed), str(total), str(GAP)], check=True
            )
            wait_until(self.starts.exists, worker, 60, "the jobs to start")
        finally:
            stop(worker)
        done = json.loads(committed.read_text())
        started = json.loads(self.starts.read_text())
        millis = [(started[k] - done[k]) * 1000 for k in done if int(k) >= WARMUP]
        q = statistics.quantiles(millis, n=100, method="inclusive")
        return {"p50_ms": q[49], "p99_ms": q[98]}

    def enqueue(self, dsn: str, count: int, batch: int) -> dict[str, float]:
        done = subprocess.run(
            [*self.side, "enqueue", dsn, str(count), str(batch)], check=True,
            capture_output=True, text=True,
        )
        figures: dict[str, float] = json.loads(done.stdout)
        return figures

    def drain(self, dsn: str, batch: int) -> dict[str, float]:
        subprocess.run([*self.side, "fill", dsn, str(DRAIN)], check=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgqueuer")

            def empty() -> bool:
                row = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
                return row is not None and row[0] == 0

            worker = self.start_worker(dsn, DRAIN, batch)
            try:
                # Seldom: a count of the queue table competes with the worker for the CPUs.
                wait_until(empty, worker, 60 + DRAIN / 500, "the jobs to drain", interval=0.25)
                wait_until(self.starts.exists, worker, 30, "the worker's start times")
            finally:
                stop(worker)
            # The last acknowledgement's transaction time, as our drains take `completed_at`.
            row = conn.execute(
                "SELECT extract(epoch FROM max(created)) FROM pgqueuer_log"
                " WHERE status = 'successful'"
            ).fetchone()
        if row is None or row[0] is None:
            raise RuntimeError("no acknowledgement in pgqueuer_log")
        first = min(json.loads(self.starts.read_text()).values())
        return {"tasks_per_s": DRAIN / (float(row[0]) - first)}


def wait_until(
    done: Callable[[], bool], proc: subprocess.Popen[bytes], seconds: float, what: str,
    interval: float = 0.01,
) -> None:
    """``run.py``'s ``wait_until``, for a worker that ends by itself once its jobs ran: ``done``
    turning true as the worker exits is no failure."""
    deadline = time.monotonic() + seconds
    while not done():
        if proc.poll() is not None and not done():
            raise RuntimeError(f"{what}: the PgQueuer worker exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {seconds:.0f} s")
        time.sleep(interval)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Wait for the worker to end by itself (it stops after its last job), else kill it."""
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ours(server_url: str, tmp: Path, workload: str) -> dict[str, float]:
    """``workload`` of ``run.py``, once, in its own throwaway database."""
    out = tmp / "library.json"
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("run.py")), "--database-url", server_url,
         "--only", workload, "--horizon-wait", "5", "--json", str(out)],
        capture_output=True, text=True,
    )
    if done.returncode:
        raise RuntimeError(f"run.py exited with {done.returncode}: {done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(out.read_text())["runs"][0][workload]
    if "error" in figures:
        raise RuntimeError(f"run.py {workload} failed: {figures['error']}")
    if workload == "latency":
        return {"p50_ms": float(figures["p50_ms"]), "p99_ms": float(figures["p99_ms"])}
    return {"tasks_per_s": float(figures["value"])}


#: Ours in ``run.py``, and PgQueuer's (count, batch) for the enqueues.
WORKLOADS: dict[str, tuple[str, tuple[int, int] | None]] = {
    "enqueue_single": ("enqueue_single", (2_000, 1)),
    "enqueue_many": ("enqueue_many", (20_000, 1_000)),
    "latency": ("latency", None),
    "drain_c10": ("drain_c10_async", None),
    "drain_c100": ("drain_c100_async", None),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pgqueuer-python", required=True, metavar="PATH",
                        help="an interpreter with pgqueuer, asyncpg and uvloop installed")
    parser.add_argument("--database-url", metavar="URL",
                        help="a server where CREATE DATABASE works (default: provide_server)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (all)")
    args = parser.parse_args(argv)
    selected = [w.strip() for w in args.only.split(",")]
    if unknown := set(selected) - set(WORKLOADS):
        parser.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with server(args.database_url) as found, tempfile.TemporaryDirectory() as tmp:
        url = psycopg_url(found.url)
        peer = PgQueuer(args.pgqueuer_python, url, Path(tmp))
        for index in range(args.rounds):
            for workload in selected:
                ours_name, enqueue = WORKLOADS[workload]
                for name in ("pgqueuer", "sqlalchemy_pgtask"):
                    if name == "sqlalchemy_pgtask":
                        figures = ours(url, Path(tmp), ours_name)
                    elif enqueue is not None:
                        count, size = enqueue
                        figures = peer.run(functools.partial(peer.enqueue, count=count, batch=size))
                    elif workload == "latency":
                        figures = peer.run(peer.latency)
                    else:
                        batch = int(workload.removeprefix("drain_c"))
                        figures = peer.run(functools.partial(peer.drain, batch=batch))
                    results.setdefault((workload, name), []).append(figures)
                    print(f"round {index + 1} {workload:10} {name:18} {_fmt(figures)}",
                          flush=True)
    for (workload, name), rounds in results.items():
        medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"median  {workload:10} {name:18} {_fmt(medians)}")
    return 0


def _fmt(figures: dict[str, float]) -> str:
    if "tasks_per_s" in figures:
        return f"{figures['tasks_per_s']:,.0f} tasks/s"
    return f"p50 {figures['p50_ms']:.2f}  p99 {figures['p99_ms']:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
