"""benchmarks/dead_path.py: a worker behind a path to PostgreSQL that goes silent.

One command (run on demand; it is not a test)::

    .venv/bin/python benchmarks/dead_path.py [--database-url URL] [--rounds N] [--lease S]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds) and runs an in-process `Worker` through the black-hole proxy
of ``tests/support/blackhole.py`` (it keeps connections open, acks every byte, and forwards
nothing while it black-holes). Each round measures, on the worker's monotonic clock:

* **path back to claiming again**: the path goes silent for two leases with the worker polling
  (statements in flight); a task is enqueued; the path comes back: time from then to the
  handler's start;
* **watchdog stop to handler end**: an ``async def`` handler enters a durable call as the path
  goes silent; time from the watchdog's stop (its log record) to the handler's end, which
  must come before the lease can expire (a quarter of a lease later);
* **stop with a dead path**: a handler runs, the path goes silent, `Worker.shutdown` is
  called with ``shutdown_grace`` 10 s: time until `Worker.run` returns (promised: at most the
  grace and 5 s more).

It prints every round and the median and maximum of each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _server import scratch_database

from sqlalchemy_pgtask import Registry, TaskContext, Worker, WorkerOptions
from sqlalchemy_pgtask.testing import wait_until
from tests.support.blackhole import black_hole_proxy
from tests.support.tasks import add


class _Marks(logging.Handler):
    """The monotonic time of the watchdog's stop, from its log record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.stopped: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "before the lease can expire" in record.getMessage():
            self.stopped = time.monotonic()


async def _path_back(url: str, lease: float) -> float:
    registry = Registry()
    started: list[float] = []

    @registry.task("echo")
    async def echo(ctx: TaskContext, payload: None) -> None:
        started.append(time.monotonic())

    options = WorkerOptions(lease_duration=lease, poll_interval=0.2, shutdown_grace=1.0)
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    try:
        with black_hole_proxy(url) as proxy:
            worker = Worker(registry, proxy.url(url), options)
            runner = asyncio.create_task(worker.run())
            await worker.wait_until_ready(60)
            proxy.black_hole()
            await asyncio.sleep(2 * lease)  # the benchmark's own pause, not a synchronisation
            await add(engine, "echo")
            proxy.resume()
            back = time.monotonic()
            await wait_until(lambda: bool(started), 120)
            worker.shutdown(immediate=True)
            await runner
            return started[0] - back
    finally:
        await engine.dispose()


async def _watchdog(url: str, lease: float, marks: _Marks) -> float:
    registry = Registry()
    go = asyncio.Event()
    ended: list[float] = []

    @registry.task("stepper")
    async def stepper(ctx: TaskContext, payload: None) -> None:
        await ctx.step("first", lambda: 1)
        go.set()
        try:
            await ctx.step("second", lambda: 2)
        finally:
            ended.append(time.monotonic())

    # One durable connection: the second step runs on the connection the first opened, so the
    # stop meets a statement in flight on the dead path (not a connect, which ends at once).
    options = WorkerOptions(
        lease_duration=lease, poll_interval=30.0, shutdown_grace=1.0, durable_connections=1
    )
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    marks.stopped = None
    try:
        with black_hole_proxy(url) as proxy:
            worker = Worker(registry, proxy.url(url), options)
            runner = asyncio.create_task(worker.run())
            await worker.wait_until_ready(60)
            await add(engine, "stepper")
            await asyncio.wait_for(go.wait(), 60)
            proxy.black_hole()
            await wait_until(lambda: bool(ended) and marks.stopped is not None, 120)
            worker.shutdown(immediate=True)
            await runner
            assert marks.stopped is not None
            return ended[0] - marks.stopped
    finally:
        await engine.dispose()


async def _stop(url: str, lease: float) -> float:
    registry = Registry()
    running = asyncio.Event()

    @registry.task("sleeper")
    async def sleeper(ctx: TaskContext, payload: None) -> None:
        running.set()
        await asyncio.sleep(3600)

    options = WorkerOptions(lease_duration=lease, poll_interval=0.1, shutdown_grace=10.0)
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    try:
        with black_hole_proxy(url) as proxy:
            worker = Worker(registry, proxy.url(url), options)
            runner = asyncio.create_task(worker.run())
            await worker.wait_until_ready(60)
            await add(engine, "sleeper")
            await asyncio.wait_for(running.wait(), 60)
            proxy.black_hole()
            swallowed = proxy.swallowed
            await wait_until(lambda: proxy.swallowed >= swallowed + 3, 60)
            signalled = time.monotonic()
            worker.shutdown()
            await runner
            return time.monotonic() - signalled
    finally:
        await engine.dispose()


def _summary(name: str, values: list[float]) -> None:
    print(f"{name}: median {statistics.median(values):.3f} s, max {max(values):.3f} s")


async def _main(url: str, rounds: int, lease: float) -> None:
    marks = _Marks()
    logging.getLogger("sqlalchemy_pgtask.worker").addHandler(marks)
    logging.getLogger("sqlalchemy_pgtask.worker").setLevel(logging.WARNING)
    logging.getLogger("sqlalchemy_pgtask.worker").propagate = False
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    back, watchdog, stop = [], [], []
    for n in range(1, rounds + 1):
        back.append(await _path_back(url, lease))
        watchdog.append(await _watchdog(url, lease, marks))
        stop.append(await _stop(url, lease))
        print(f"round {n}: path back -> claiming {back[-1]:.2f} s; watchdog stop -> handler "
              f"end {watchdog[-1] * 1000:.1f} ms; stop with a dead path {stop[-1]:.2f} s",
              flush=True)
    print(f"lease {lease:g} s (quick deadline {max(lease / 3, 2.0):g} s), grace 10 s:")
    _summary("path back -> claiming again", back)
    _summary("watchdog stop -> handler end", watchdog)
    _summary("stop with a dead path (grace 10 s; promised <= 15 s)", stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lease", type=float, default=6.0)
    args = parser.parse_args()
    with scratch_database(args.database_url, "pgtask_bench_dead_path") as url:
        asyncio.run(_main(url, args.rounds, args.lease))


if __name__ == "__main__":
    main()
