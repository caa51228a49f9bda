"""benchmarks/concurrency_keys.py: what concurrency keys cost the claim (issue 26).

::

    .venv/bin/python benchmarks/concurrency_keys.py [--database-url URL] [--tasks N]
        [--repeat K]

In a throwaway database (``--database-url``, else the server ``benchmarks/_server.py``
finds), one in-process worker (concurrency 100, no-op ``async def`` handler) runs:

* ``drain_no_keys``: ``--tasks`` pre-enqueued tasks without a key, drained;
* ``drain_1000_keys``: the same with 1,000 distinct keys (limit 1, tasks spread round-robin
  over the keys, so at most 100 of them are full at a time);
  throughput = tasks / (last ``completed_at`` - first ``attempts.started_at``), both database
  times. Target: ``drain_1000_keys`` >= 0.8 of ``drain_no_keys``.
* ``cold_latency_no_keys``: an idle worker; 200 tasks enqueued 20 ms apart, each committed
  on its own; latency = its attempt's ``started_at`` - its ``created_at`` (database times);
* ``cold_latency_hot_key``: the same 200 tasks, each under a key of its own ("cold"), while
  one hot key has a backlog of 2,000 tasks (limit 1, each sleeping 20 ms, so the hot key
  stays full and its backlog stays in front of every cold task in claim order). Target: the
  cold median within 1.2x of ``cold_latency_no_keys``.

Figures are medians over the repeats; ratios are computed within each repeat. The machine
is shared (see docs/performance.md): compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from _server import scratch_database
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    Registry,
    TaskContext,
    WorkerOptions,
    enqueue_async,
    enqueue_many_async,
)
from sqlalchemy_pgtask.testing import running_worker

CONCURRENCY = 100
COLD = 200
HOT_BACKLOG = 2000

registry = Registry()


@registry.task("job")
async def job(ctx: TaskContext, payload: dict[str, Any] | None) -> None:
    if payload and payload.get("sleep"):
        await asyncio.sleep(payload["sleep"])


async def _reset(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE pgtask.tasks, pgtask.attempts CASCADE"))
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE pgtask.tasks"))


async def _enqueue(engine: AsyncEngine, requests: list[EnqueueRequest]) -> None:
    for start in range(0, len(requests), 1000):
        async with engine.begin() as conn:
            await enqueue_many_async(conn, requests[start:start + 1000])


async def _count(engine: AsyncEngine, sql: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


async def _until(engine: AsyncEngine, sql: str, wanted: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while await _count(engine, sql) < wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(sql)
        await asyncio.sleep(0.05)


_OPTIONS = WorkerOptions(concurrency=CONCURRENCY, poll_interval=1.0)


async def drain(engine: AsyncEngine, url: str, tasks: int, keys: int | None) -> float:
    await _reset(engine)
    await _enqueue(engine, [
        EnqueueRequest(name="job", concurrency_key=None if keys is None else f"k{n % keys}")
        for n in range(tasks)
    ])
    async with running_worker(registry, url, _OPTIONS):
        await _until(
            engine, "SELECT count(*) FROM pgtask.tasks WHERE state = 'succeeded'", tasks
        )
    async with engine.connect() as conn:
        span = (await conn.execute(text(
            "SELECT extract(epoch FROM (SELECT max(completed_at) FROM pgtask.tasks)"
            " - (SELECT min(started_at) FROM pgtask.attempts))"
        ))).scalar_one()
    return tasks / float(span)


async def cold_latency(engine: AsyncEngine, url: str, *, hot: bool) -> float:
    await _reset(engine)
    if hot:
        await _enqueue(engine, [
            EnqueueRequest(name="job", payload={"sleep": 0.02}, concurrency_key="hot")
            for _ in range(HOT_BACKLOG)
        ])
    async with running_worker(registry, url, _OPTIONS):
        for n in range(COLD):
            async with engine.begin() as conn:
                await enqueue_async(
                    conn, "job", {"cold": n}, concurrency_key=f"cold-{n}" if hot else None
                )
            await asyncio.sleep(0.02)  # the producer's pace, not synchronisation
        await _until(
            engine, "SELECT count(*) FROM pgtask.tasks WHERE state = 'succeeded'"
            " AND payload ? 'cold'", COLD,
        )
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT extract(epoch FROM a.started_at - t.created_at) FROM pgtask.tasks AS t"
            " JOIN pgtask.attempts AS a ON a.task_id = t.id AND a.attempt = 1"
            " WHERE t.payload ? 'cold'"
        ))).scalars().all()
    return statistics.median(float(r) for r in rows) * 1000.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs: list[dict[str, float]] = []
    with scratch_database(args.database_url, "pgtask_bench_keys") as url:
        engine = create_async_engine(url)
        try:
            for _ in range(args.repeat):
                run = {
                    "drain_no_keys": await drain(engine, url, args.tasks, None),
                    "drain_1000_keys": await drain(engine, url, args.tasks, 1000),
                    "cold_latency_no_keys_ms": await cold_latency(engine, url, hot=False),
                    "cold_latency_hot_key_ms": await cold_latency(engine, url, hot=True),
                }
                run["drain_ratio"] = run["drain_1000_keys"] / run["drain_no_keys"]
                run["cold_latency_ratio"] = (
                    run["cold_latency_hot_key_ms"] / run["cold_latency_no_keys_ms"]
                )
                runs.append(run)
                print(json.dumps(run), flush=True)
        finally:
            await engine.dispose()
    medians = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    print(json.dumps({"median": medians, "runs": runs}, indent=2))
    print(f"drain with 1,000 keys / without: {medians['drain_ratio']:.2f} (target >= 0.8)")
    print(f"cold-key latency with a hot key / no keys: {medians['cold_latency_ratio']:.2f}"
          " (target <= 1.2)")


if __name__ == "__main__":
    asyncio.run(main())
