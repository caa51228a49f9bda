"""benchmarks/retention.py: retention against a large finished history while a worker drains.

One command (run on demand; it is not a test)::

    .venv/bin/python benchmarks/retention.py [--database-url URL] [--history N] [--drain N]
                                             [--concurrency C] [--batch-size B] [--runs R]
                                             [--paced]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds), installs the schema with the
shipped revisions, and drops it afterwards. Two phases:

1. **Drain alone**: ``--drain`` pending no-op tasks (default 20,000) drained by one ``pgtask
   worker`` subprocess at concurrency ``C`` (default 50): tasks per second, database times
   (first attempt start to last completion).
2. **Drain during retention**: ``--history`` finished tasks (default 1,000,000; ``succeeded``,
   finished 30 days ago, one attempt row each, every 10th with an idempotency key) are
   inserted with ``INSERT ... SELECT generate_series`` and analysed; ``R`` concurrent
   `run_retention` calls (default 1, batches of ``B``, default 1,000) start deleting them,
   and once the first batches have committed, the same drain runs again. Reported: the
   drain's tasks per second while retention ran, retention's rows per second (finished tasks
   deleted, with their attempts, over its wall time), and whether every claim of the drain
   happened while retention was running. ``--paced`` runs retention at the worker service's
   pace instead (16 batches of each kind, a 0.1 s pause, again). Every 0.1 s it also looks
   for any backend of the database waiting for a lock (``pg_stat_activity.wait_event_type =
   'Lock'``): a claim or completion held up by retention would show there.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from _server import libpq_url, scratch_database
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import EnqueueRequest, enqueue_many
from sqlalchemy_pgtask.retention import RetentionResult, run_retention

TASKS_MODULE = "retention_bench_tasks"
TASKS_SOURCE = textwrap.dedent(
    '''
    """Handlers for benchmarks/retention.py (written to a temporary directory)."""

    from sqlalchemy_pgtask import Registry

    registry = Registry()


    @registry.task("noop")
    async def noop(ctx, payload):
        return None
    '''
)

FILL_SQL = """
WITH made AS (
    INSERT INTO pgtask.tasks (queue, name, payload, state, attempt, failed_attempts,
                              max_attempts, created_at, updated_at, completed_at,
                              idempotency_key)
    SELECT 'default', 'history', '{"i": 1}', 'succeeded', 1, 0, 5,
           statement_timestamp() - interval '31 days',
           statement_timestamp() - interval '30 days' + make_interval(secs => i * 0.001),
           statement_timestamp() - interval '30 days' + make_interval(secs => i * 0.001),
           CASE WHEN i %% 10 = 0 THEN 'history-' || i END
    FROM generate_series(%(start)s, %(stop)s) AS i
    RETURNING id, idempotency_key, completed_at
), attempts AS (
    INSERT INTO pgtask.attempts (task_id, attempt, lease_token, state, started_at, finished_at)
    SELECT id, 1, gen_random_uuid(), 'succeeded', completed_at - interval '1 second',
           completed_at
    FROM made
)
INSERT INTO pgtask.idempotency_keys (queue, key, task_id, created_at)
SELECT 'default', idempotency_key, id, completed_at FROM made
WHERE idempotency_key IS NOT NULL
"""


def scalar(conninfo: str, sql: str, params: Any = None) -> Any:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        row = cursor.fetchone() if cursor.description else None
        return None if row is None else row[0]


def wait_for(check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None,
             timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def worker(url: str, directory: Path, concurrency: int, label: str) -> Iterator[
    subprocess.Popen[bytes]
]:
    script = Path(sys.executable).with_name("pgtask")
    command = [str(script), "worker", f"{TASKS_MODULE}:registry", "--database-url", url,
               "--concurrency", str(concurrency), "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(directory))
    with (directory / f"{label}.log").open("wb") as log:
        proc = subprocess.Popen(command, cwd=directory, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def preload(url: str, count: int) -> None:
    engine = create_engine(url)
    try:
        for start in range(0, count, 1000):
            with Session(engine) as session:
                enqueue_many(session, [EnqueueRequest(name="noop", payload={"i": i})
                                       for i in range(start, min(count, start + 1000))])
                session.commit()
    finally:
        engine.dispose()


def drain(url: str, conninfo: str, directory: Path, args: argparse.Namespace,
          label: str) -> tuple[float, float, float]:
    """Preload and drain ``--drain`` no-op tasks; (tasks/s, first claim, last completion)
    as epoch seconds of database time."""
    preload(url, args.drain)
    scalar(conninfo, "ANALYZE pgtask.tasks")
    with worker(url, directory, args.concurrency, label) as proc:
        wait_for(lambda: scalar(conninfo, "SELECT count(*) FROM pgtask.tasks WHERE name = 'noop'"
                                " AND state <> 'succeeded'") == 0, f"{label} to drain", proc)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), extract(epoch FROM min(a.started_at)),"
            " extract(epoch FROM max(t.completed_at))"
            " FROM pgtask.tasks AS t JOIN pgtask.attempts AS a ON a.task_id = t.id"
            " WHERE t.name = 'noop'"
        ).fetchone()
        assert row is not None
        done, first, last = int(row[0]), float(row[1]), float(row[2])
        conn.execute("DELETE FROM pgtask.tasks WHERE name = 'noop'")
        conn.execute("VACUUM ANALYZE pgtask.tasks")
    return done / (last - first), first, last


def fill(conninfo: str, count: int) -> float:
    started = time.monotonic()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for start in range(1, count + 1, 100_000):
            conn.execute(FILL_SQL, {"start": start, "stop": min(count, start + 99_999)})
        conn.execute("VACUUM ANALYZE pgtask.tasks")
        conn.execute("VACUUM ANALYZE pgtask.attempts")
        conn.execute("VACUUM ANALYZE pgtask.idempotency_keys")
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--drain", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=1, help="concurrent retention runs")
    parser.add_argument("--paced", action="store_true",
                        help="at the worker service's pace: 16 batches, 0.1 s pause, again")
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database(args.database_url, "pgtask_bench_retention"))
        conninfo = libpq_url(url)
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (directory / f"{TASKS_MODULE}.py").write_text(TASKS_SOURCE)

        alone, _, _ = drain(url, conninfo, directory, args, "alone")
        print(f"drain alone: {args.drain} tasks at {alone:,.0f} tasks/s", flush=True)

        seconds = fill(conninfo, args.history)
        print(f"filled {args.history:,} finished tasks (+ attempts, every 10th keyed) in "
              f"{seconds:.1f}s", flush=True)

        results: list[RetentionResult] = []
        errors: list[BaseException] = []

        def retention() -> None:
            engine = create_engine(url)
            try:
                if not args.paced:
                    results.append(run_retention(engine, batch_size=args.batch_size))
                    return
                # The worker service's pace: 16 batches of each kind, a 0.1 s pause, again.
                while True:
                    result = run_retention(engine, batch_size=args.batch_size, max_batches=16)
                    results.append(result)
                    if result.tasks_deleted < 16 * args.batch_size:
                        return
                    time.sleep(0.1)
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                engine.dispose()

        started = time.monotonic()
        runners = [threading.Thread(target=retention) for _ in range(args.runs)]
        for runner in runners:
            runner.start()
        samples: list[tuple[float, int]] = []
        sampling = threading.Event()

        lock_waits: list[str] = []
        polls = [0]

        def sample() -> None:
            """History left every 2 s (does a batch get slower as it goes?), and every 0.1 s
            any backend of this database waiting for a lock (a blocked claim would show)."""
            with psycopg.connect(conninfo, autocommit=True) as conn:
                last = 0.0
                while not sampling.wait(0.1):
                    polls[0] += 1
                    lock_waits.extend(
                        f"{r[0]}: {r[1]}" for r in conn.execute(
                            "SELECT wait_event, left(query, 80) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                        ).fetchall()
                    )
                    if time.monotonic() - last >= 2.0:
                        last = time.monotonic()
                        row = conn.execute("SELECT count(*) FROM pgtask.tasks"
                                           " WHERE name = 'history'").fetchone()
                        assert row is not None
                        samples.append((last - started, int(row[0])))

        sampler = threading.Thread(target=sample)
        sampler.start()
        wait_for(lambda: scalar(conninfo, "SELECT count(*) FROM pgtask.tasks") < args.history,
                 "the first retention batch", None)
        during, first, last = drain(url, conninfo, directory, args, "during")
        drained_at = time.monotonic()
        for runner in runners:
            runner.join()
        elapsed = time.monotonic() - started
        sampling.set()
        sampler.join()
        if errors:
            raise errors[0]
        deleted = sum(r.tasks_deleted for r in results)
        keys = sum(r.keys_deleted for r in results)
        batches = sum(r.batches for r in results)
        overlapped = drained_at - started < elapsed
        print(f"drain during retention: {args.drain} tasks at {during:,.0f} tasks/s "
              f"({during / alone:.2f} of the drain alone)")
        print(f"retention: {deleted:,} finished tasks (and their attempts), {keys:,} keys "
              f"in {batches:,} batches of {args.batch_size}, {elapsed:.1f}s, "
              f"{deleted / elapsed:,.0f} tasks/s with {args.runs} run(s)")
        print(f"the whole drain ran while retention ran: {overlapped} "
              f"(drain {last - first:.1f}s, finished {drained_at - started:.1f}s into "
              f"retention's {elapsed:.1f}s)")
        left = scalar(conninfo, "SELECT count(*) FROM pgtask.tasks")
        print(f"tasks left: {left}")
        print(f"backends seen waiting for a lock: {len(lock_waits)} in {polls[0]} polls"
              + "".join(f"\n  {w}" for w in lock_waits[:10]))
        quarters = [q * args.history // 4 for q in (4, 3, 2, 1, 0)]
        for high, low in itertools.pairwise(quarters):
            inside = [(t, n) for t, n in samples if low <= n <= high]
            if len(inside) >= 2:
                (t0, n0), (t1, n1) = inside[0], inside[-1]
                print(f"  retention rate with {high:,} to {low:,} left: "
                      f"{(n0 - n1) / (t1 - t0):,.0f} tasks/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
