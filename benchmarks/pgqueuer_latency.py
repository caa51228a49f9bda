"""benchmarks/pgqueuer_latency.py: enqueue-to-start latency of PgQueuer and of this library,
alternated on the same host.

::

    python3 -m venv /tmp/pgq && /tmp/pgq/bin/pip install "pgqueuer==1.6.0" asyncpg uvloop
    .venv/bin/python benchmarks/pgqueuer_latency.py --pgqueuer-python /tmp/pgq/bin/python \\
        [--database-url URL] [--rounds 3]

The issue's latency target (p50 <= 1.2 ms, p99 <= 2.5 ms) is PgQueuer's figure on another
host, and on a virtual machine whose idle vCPUs halt, latency is mostly wake-ups
(`idle_costs.py`). This script measures the peer here, so the two can be compared on the
same host. PgQueuer runs in its own interpreter (``--pgqueuer-python``: it is no dependency
of this project), with the shape of ``run.py``'s ``latency`` workload: a worker
(``QueueManager``, asyncpg, uvloop, ``batch_size=10`` like our concurrency 10) that has been
idle for a second, and a producer that enqueues one job every 20 ms on its own connection; 20
warm-up jobs, then 200 timed from the producer's commit to the handler's start. Each round
runs PgQueuer in a fresh database, then ``run.py --only latency`` (same counts), and prints
both; the last lines are the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from _server import libpq_url, psycopg_url, server

from sqlalchemy_pgtask.testing import create_database, drop_database

WARMUP, TIMED, GAP = 20, 200, 0.020

#: Run by ``--pgqueuer-python``: ``install DSN``, ``worker DSN OUT READY TOTAL`` or ``produce
#: DSN OUT TOTAL GAP``. Times are wall-clock (``time.time``): worker and producer are two
#: processes.
PGQUEUER_SIDE = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from datetime import timedelta

    import asyncpg, uvloop
    from pgqueuer import Queries, QueueManager
    from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver

    async def install(dsn):
        conn = await asyncpg.connect(dsn)
        await Queries(AsyncpgDriver(conn)).install()
        await conn.close()

    async def worker(dsn, out, ready, total):
        conn = await asyncpg.connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        starts = {}

        @qm.entrypoint("noop")
        async def noop(job):
            starts[job.payload.decode()] = time.time()
            if len(starts) == total:
                with open(out, "w") as f:
                    json.dump(starts, f)
                qm.shutdown.set()

        asyncio.get_running_loop().call_later(0.5, lambda: open(ready, "w").close())
        await qm.run(batch_size=10, dequeue_timeout=timedelta(seconds=30))

    async def produce(dsn, out, total, gap):
        conn = await asyncpg.connect(dsn)
        queries = Queries(AsyncpgDriver(conn))
        committed = {}
        next_at = time.monotonic()
        for i in range(total):
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            next_at += gap
            await queries.enqueue("noop", str(i).encode())  # autocommit: one INSERT
            committed[str(i)] = time.time()
        with open(out, "w") as f:
            json.dump(committed, f)

    mode, dsn = sys.argv[1], sys.argv[2]
    if mode == "install":
        uvloop.run(install(dsn))
    elif mode == "worker":
        uvloop.run(worker(dsn, sys.argv[3], sys.argv[4], int(sys.argv[5])))
    else:
        uvloop.run(produce(dsn, sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
    """
)


def wait_for(path: Path, proc: subprocess.Popen[bytes], deadline: float, what: str) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the PgQueuer worker exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within the deadline")
        time.sleep(0.01)


def cuts(millis: list[float]) -> dict[str, float]:
    q = statistics.quantiles(millis, n=100, method="inclusive")
    return {"p50_ms": q[49], "p95_ms": q[94], "p99_ms": q[98]}


def pgqueuer_round(python: str, server_url: str, tmp: Path) -> dict[str, float]:
    raw = create_database(server_url, "pgqueuer_latency")
    dsn = libpq_url(raw)
    total = str(WARMUP + TIMED)
    starts, committed, ready = tmp / "starts.json", tmp / "committed.json", tmp / "ready"
    for path in (starts, committed, ready):
        path.unlink(missing_ok=True)
    try:
        side = [python, "-c", PGQUEUER_SIDE]
        subprocess.run([*side, "install", dsn], check=True, capture_output=True)
        worker = subprocess.Popen([*side, "worker", dsn, str(starts), str(ready), total],
                                  stdout=subprocess.DEVNULL)
        try:
            wait_for(ready, worker, time.monotonic() + 60, "the worker to start")
            time.sleep(1.0)  # its first dequeue has run and it is asleep, as in run.py
            subprocess.run(
                [*side, "produce", dsn, str(committed), total, str(GAP)], check=True
            )
            wait_for(starts, worker, time.monotonic() + 60, "the jobs to start")
            worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    finally:
        drop_database(raw)
    done = json.loads(committed.read_text())
    started = json.loads(starts.read_text())
    millis = [(started[k] - done[k]) * 1000 for k in done if int(k) >= WARMUP]
    return cuts(millis)


def library_round(server_url: str, tmp: Path) -> dict[str, float]:
    out = tmp / "library.json"
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("run.py")), "--database-url", server_url,
         "--only", "latency", "--horizon-wait", "5", "--json", str(out)],
        capture_output=True, text=True,
    )
    if done.returncode:
        raise RuntimeError(f"run.py exited with {done.returncode}: {done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(out.read_text())["runs"][0]["latency"]
    if "error" in figures:
        raise RuntimeError(f"run.py latency failed: {figures['error']}")
    return {key: float(figures[key]) for key in ("p50_ms", "p95_ms", "p99_ms")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pgqueuer-python", required=True, metavar="PATH",
                        help="an interpreter with pgqueuer, asyncpg and uvloop installed")
    parser.add_argument("--database-url", metavar="URL",
                        help="a server where CREATE DATABASE works (default: provide_server)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"pgqueuer": [], "sqlalchemy_pgtask": []}
    with server(args.database_url) as found, tempfile.TemporaryDirectory() as tmp:
        url = psycopg_url(found.url)
        for index in range(args.rounds):
            for name in results:
                figures = (
                    pgqueuer_round(args.pgqueuer_python, url, Path(tmp)) if name == "pgqueuer"
                    else library_round(url, Path(tmp))
                )
                results[name].append(figures)
                print(f"round {index + 1} {name:18} p50 {figures['p50_ms']:.2f}"
                      f"  p95 {figures['p95_ms']:.2f}  p99 {figures['p99_ms']:.2f} ms",
                      flush=True)
    for name, rounds in results.items():
        medians = {k: statistics.median(r[k] for r in rounds) for k in ("p50_ms", "p99_ms")}
        print(f"median {name:17} p50 {medians['p50_ms']:.2f}  p99 {medians['p99_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
