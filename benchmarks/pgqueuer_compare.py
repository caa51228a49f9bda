"""benchmarks/pgqueuer_compare.py: PgQueuer and this library side by side on the same host:
enqueues, enqueue-to-start latency and drains at concurrency 10 and 100, alternated.

::

    python3 -m venv /tmp/pgq && /tmp/pgq/bin/pip install "pgqueuer==1.6.0" asyncpg uvloop
    .venv/bin/python benchmarks/pgqueuer_compare.py --pgqueuer-python /tmp/pgq/bin/python \\
        [--database-url URL] [--rounds 3] [--quick] [--only enqueue_single,latency,...]

``benchmarks/compare.py`` runs this and ``dbos_compare.py`` and prints the issue's whole table.

The performance issue's figures for PgQueuer (the fastest Python peer on PostgreSQL: asyncpg,
no fencing, no attempt history) come from another host, and this host's figures swing with
its load, so the peer is measured here, in turn with ``run.py``. PgQueuer runs in its own
interpreter (``--pgqueuer-python``: it is no dependency of this project), a fresh database per
measurement, its worker a ``QueueManager`` on asyncpg and uvloop:

* ``enqueue_single``, ``enqueue_many``: 2,000 jobs one ``enqueue`` call each (an autocommit
  ``INSERT``: PgQueuer enqueues outside any transaction of the caller), and 20,000 in calls
  of 1,000 (one statement each), after 20 to warm up; tasks/s of the loop. Ours: ``run.py
  --only enqueue_single`` (``BEGIN``, the insert, ``COMMIT``: inside the caller's
  transaction) / ``enqueue_many``. ``enqueue_session``: PgQueuer's single enqueue against
  ``run.py --only enqueue_single_session`` (a ``Session`` per task, pool checkout included).
* ``latency``: as ``run.py``'s ``latency``: a worker with ``batch_size=10`` (our concurrency
  10) idle for a second, a producer that enqueues one job every 20 ms on its own connection
  (an autocommit ``INSERT``); 20 warm-up jobs, then 200 timed from the producer's commit to
  the handler's start. Ours: ``run.py --only latency``.
* ``drain_c10``, ``drain_c100``: 20,000 jobs enqueued in batches of 1,000, then one worker
  with ``batch_size`` 10 or 100 (PgQueuer's concurrency knob: the jobs it fetches per
  dequeue; running jobs are not capped) and a no-op ``async`` handler drains them; tasks/s
  from the first handler start to the transaction time of the last acknowledgement (its
  ``pgqueuer_log`` row). Ours: ``run.py --only drain_c10_async`` / ``drain_c100_async``
  (first attempt start to last completion, in database time). Both also give CPU per task:
  the worker's (PgQueuer's counts itself from a start signal sent once it has connected, to
  its exit; ours from its registration to the drained queue) plus every ``postgres``
  process's on this host over the same span (``/proc``; other databases' load included).

Rounds alternate which side goes first; ``--quick`` counts 500 single enqueues and drains
5,000 jobs, one round.

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
from _compare import (
    Figures,
    add_arguments,
    pair,
    run_ours,
    run_rounds,
    selected,
    stop,
    wait_until,
)
from _server import libpq_url, psycopg_url, server
from run import postgres_cpu

from sqlalchemy_pgtask.testing import create_database, drop_database

WARMUP, TIMED, GAP = 20, 200, 0.020
DRAIN = 20_000

#: Run by ``--pgqueuer-python`` as ``MODE DSN ...``: ``install``; ``fill N``; ``enqueue N
#: BATCH`` (prints the enqueue's tasks/s, each call its own autocommit statement); ``worker OUT
#: READY TOTAL BATCH GO`` (handler start times to OUT once TOTAL jobs ran, READY once running;
#: GO ``-``, or a file it waits for after READY, then its CPU seconds from GO on to OUT.cpu,
#: then it waits for GO.stop);
#: ``produce OUT TOTAL GAP`` (commit times to OUT). Wall-clock times (``time.time``): the
#: worker and the producer are two processes.
PGQUEUER_SIDE = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
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

    async def worker(dsn, out, ready, total, batch, go):
        qm = QueueManager(await queries(dsn))
        starts = {}

        @qm.entrypoint("noop")
        async def noop(job):
            starts[job.payload.decode()] = time.time()
            if len(starts) == total:
                with open(out, "w") as f:
                    json.dump(starts, f)
                qm.shutdown.set()

        if go == "-":
            asyncio.get_running_loop().call_later(0.5, lambda: open(ready, "w").close())
        else:  # gated: connected and imported, it waits for GO so its CPU can be counted
            open(ready, "w").close()
            while not os.path.exists(go):
                await asyncio.sleep(0.005)
        cpu0 = time.process_time()
        await qm.run(batch_size=batch, dequeue_timeout=timedelta(seconds=30))
        if go != "-":
            with open(out + ".cpu", "w") as f:
                f.write(str(time.process_time() - cpu0))
            # Connected until GO.stop: the server's CPU is read while its backends live.
            while not os.path.exists(go + ".stop"):
                await asyncio.sleep(0.005)

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
        uvloop.run(worker(dsn, rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4]))
    else:
        uvloop.run(produce(dsn, rest[0], int(rest[1]), float(rest[2])))
    """
)


class PgQueuer:
    """One PgQueuer measurement: a fresh database with its schema, and its processes."""

    def __init__(self, python: str, server_url: str, tmp: Path, drain: int = DRAIN) -> None:
        self.side = [python, "-c", PGQUEUER_SIDE]
        self.server_url = server_url
        self.tmp = tmp
        self.drain_count = drain
        self.starts, self.ready, self.go = tmp / "starts.json", tmp / "ready", tmp / "go"
        self.cpu = tmp / "starts.json.cpu"

    def run(self, measure: Callable[[str], Figures]) -> Figures:
        raw = create_database(self.server_url, "pgqueuer_compare")
        try:
            dsn = libpq_url(raw)
            subprocess.run([*self.side, "install", dsn], check=True, capture_output=True)
            return measure(dsn)
        finally:
            drop_database(raw)

    def start_worker(
        self, dsn: str, total: int, batch: int, gated: bool = False
    ) -> subprocess.Popen[bytes]:
        for path in (self.starts, self.ready, self.go, self.cpu, Path(f"{self.go}.stop")):
            path.unlink(missing_ok=True)
        return subprocess.Popen(
            [*self.side, "worker", dsn, str(self.starts), str(self.ready), str(total),
             str(batch), str(self.go) if gated else "-"],
            stdout=subprocess.DEVNULL,
        )

    def latency(self, dsn: str) -> Figures:
        total = WARMUP + TIMED
        committed = self.tmp / "committed.json"
        worker = self.start_worker(dsn, total, 10)
        try:
            wait_until(self.ready.exists, worker, 60, "the worker to start", peer="PgQueuer")
            time.sleep(1.0)  # its first dequeue has run and it is asleep, as in run.py
            subprocess.run(
                [*self.side, "produce", dsn, str(committed), str(total), str(GAP)], check=True
            )
            wait_until(self.starts.exists, worker, 60, "the jobs to start", peer="PgQueuer")
        finally:
            stop(worker)
        done = json.loads(committed.read_text())
        started = json.loads(self.starts.read_text())
        millis = [(started[k] - done[k]) * 1000 for k in done if int(k) >= WARMUP]
        q = statistics.quantiles(millis, n=100, method="inclusive")
        return {"p50_ms": q[49], "p99_ms": q[98]}

    def enqueue(self, dsn: str, count: int, batch: int) -> Figures:
        done = subprocess.run(
            [*self.side, "enqueue", dsn, str(count), str(batch)], check=True,
            capture_output=True, text=True,
        )
        figures: Figures = json.loads(done.stdout)
        return figures

    def drain(self, dsn: str, batch: int) -> Figures:
        """Tasks/s, and CPU per task: the worker's (its own count from GO to its exit) plus
        every ``postgres`` process's on this host over the same span."""
        count = self.drain_count
        subprocess.run([*self.side, "fill", dsn, str(count)], check=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgqueuer")

            def empty() -> bool:
                row = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
                return row is not None and row[0] == 0

            worker = self.start_worker(dsn, count, batch, gated=True)
            try:
                wait_until(self.ready.exists, worker, 60, "the worker to start", peer="PgQueuer")
                server_cpu0 = postgres_cpu()
                self.go.touch()
                # Seldom: a count of the queue table competes with the worker for the CPUs.
                wait_until(empty, worker, 60 + count / 500, "the jobs to drain", interval=0.25,
                           peer="PgQueuer")
                wait_until(self.cpu.exists, worker, 30, "the worker's CPU", peer="PgQueuer")
                server_cpu = postgres_cpu() - server_cpu0
                Path(f"{self.go}.stop").touch()
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
        worker_cpu = float(self.cpu.read_text())
        return {"tasks_per_s": count / (float(row[0]) - first),
                "cpu_ms_per_task": (worker_cpu + server_cpu) / count * 1000}


def ours(tmp: Path, url: str, workload: str, quick: bool) -> Figures:
    """``workload`` of ``run.py``, once, in its own throwaway database."""
    args = ["--database-url", url, "--only", workload, "--horizon-wait", "5"]
    document = run_ours("run.py", [*args, "--quick"] if quick else args, tmp / "library.json")
    figures: dict[str, Any] = document["runs"][0][workload]
    if "error" in figures:
        raise RuntimeError(f"run.py {workload} failed: {figures['error']}")
    if workload == "latency":
        return {"p50_ms": float(figures["p50_ms"]), "p99_ms": float(figures["p99_ms"])}
    result = {"tasks_per_s": float(figures["value"])}
    if "cpu_us_per_task" in figures:
        result["cpu_ms_per_task"] = float(figures["cpu_us_per_task"]) / 1000
    return result


#: Ours in ``run.py``, and PgQueuer's (count, batch) for the enqueues (counts for a full run).
WORKLOADS: dict[str, tuple[str, tuple[int, int] | None]] = {
    "enqueue_single": ("enqueue_single", (2_000, 1)),
    "enqueue_session": ("enqueue_single_session", (2_000, 1)),
    "enqueue_many": ("enqueue_many", (20_000, 1_000)),
    "latency": ("latency", None),
    "drain_c10": ("drain_c10_async", None),
    "drain_c100": ("drain_c100_async", None),
}


def measure(
    peer: PgQueuer, url: str, workload: str, ours_first: bool, quick: bool
) -> tuple[Figures, Figures]:
    """(PgQueuer's, ours) figures for one round of ``workload``."""
    ours_name, enqueue = WORKLOADS[workload]

    def theirs() -> Figures:
        if enqueue is not None:
            count, size = enqueue
            if quick and size == 1:
                count = 500  # run.py --quick's single enqueues
            return peer.run(functools.partial(peer.enqueue, count=count, batch=size))
        if workload == "latency":
            return peer.run(peer.latency)
        batch = int(workload.removeprefix("drain_c"))
        return peer.run(functools.partial(peer.drain, batch=batch))

    return pair(theirs, lambda: ours(peer.tmp, url, ours_name, quick), ours_first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pgqueuer-python", required=True, metavar="PATH",
                        help="an interpreter with pgqueuer, asyncpg and uvloop installed")
    add_arguments(parser, list(WORKLOADS))
    args = parser.parse_args(argv)
    names = selected(parser, args, list(WORKLOADS))
    with server(args.database_url) as found, tempfile.TemporaryDirectory() as tmp:
        url = psycopg_url(found.url)
        peer = PgQueuer(args.pgqueuer_python, url, Path(tmp), 5_000 if args.quick else DRAIN)
        run_rounds(names, args.rounds, "pgqueuer",
                   lambda workload, first: measure(peer, url, workload, first, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
