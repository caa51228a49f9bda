"""benchmarks/run.py: throughput and latency of sqlalchemy_pgtask against raw-SQL baselines.

One command::

    .venv/bin/python benchmarks/run.py [--database-url URL] [--quick] [--repeat K]

It creates a throwaway database on the server (``--database-url``, else the server that
``benchmarks/_server.py`` finds), installs the
schema with the shipped revisions, runs every workload ``K`` times and drops the database.
Every workload starts from emptied ``pgtask.tasks``/``pgtask.attempts`` (TRUNCATE ... CASCADE,
VACUUM ANALYZE, CHECKPOINT), so no run inherits another's dead rows or pending WAL flush.

Workloads (``--quick`` shrinks the counts):

* ``baseline_insert``: raw psycopg, one ``INSERT`` + ``COMMIT`` per task (the ceiling for
  ``enqueue_single``).
* ``enqueue_single``: ``enqueue(connection, ...); connection.commit()`` per task on one held
  connection (the raw loop's shape); ``enqueue_single_session`` opens a ``Session`` per task
  (``with Session(engine) as s: enqueue(s, ...); s.commit()``), pool checkout included.
* ``enqueue_many``: `enqueue_many` in batches of 1,000, one transaction per batch (which
  goes by ``COPY``); ``baseline_copy`` is raw psycopg ``COPY`` of the same batches.
* ``baseline_claim_complete``: one raw autocommit psycopg connection claiming up to 100 due
  tasks with one statement (attempt rows included) and completing them with one fenced
  statement; no handler dispatch (the ceiling for the drains). ``baseline_claim_complete_b10``
  is the same loop with batches of 10 (a diagnostic, not a target: a worker at concurrency 10
  cannot claim more than 10 at once).
* ``drain_c{10,100}_{async,sync}``: pre-enqueued no-op tasks drained by one ``pgtask worker``
  subprocess. Throughput = tasks / (last ``completed_at`` - first ``attempts.started_at``),
  both database times, so process start-up is excluded.
* ``latency``: an idle worker (concurrency 10); tasks enqueued 20 ms apart, each committed on
  its own; latency = handler start (``time.time()`` returned by the handler) - the producer's
  ``time.time()`` right after its commit returned (same host clock); also PostgreSQL's CPU per
  task (per wake-up), the producer's enqueue included.
* ``drain_c100_future`` and ``latency_future``: ``drain_c100_async`` and ``latency`` with
  200,000 more tasks in the queue due in an hour: future work must cost nothing.
* ``enqueue_many_10kb`` and ``drain_c100_10kb``: ``enqueue_many`` and ``drain_c100_async`` of
  5,000 tasks with ~10 KB payloads (order-like documents that TOAST compresses about 3x).
* ``drain_c100_50k``: ``drain_c100_async`` of 50,000 tasks, for the worker's peak resident
  set (``VmHWM``, which every drain reports as ``worker_peak_rss_mb``).

Figures are medians over the repeats; ratios are computed within each repeat (same machine
state) and their median is compared with the targets. The table is printed, then the JSON
document, which is also written to ``--json`` (default ``benchmarks/results.json``).

Shared servers: a transaction that stays open in ANY database of the cluster (an idle test
session, a migration waiting on a lock) holds back the xmin of every snapshot, so dead row
versions left by claims and completions can be neither pruned nor marked dead in the claim
index, and every claim re-walks all tasks claimed so far. Before each workload the run waits up
to ``--horizon-wait`` seconds for such transactions (older than 2 s) to end, watches for them
while measuring, and flags affected figures (``horizon_held_by`` in the JSON, "HORIZON HELD" in
the table).

Profiling: ``--py-spy DIR`` records every worker with ``py-spy record --format raw``
(collapsed stacks, wall time: on 2 shared vCPUs a sample in a socket send often means the
worker was preempted by the PostgreSQL backend it just woke); ``--cprofile DIR`` runs cProfile
in the worker's event-loop thread (``PGTASK_BENCH_CPROFILE``, a hook in the generated tasks
module). Figures from a profiled run are not comparable with unprofiled ones. ``--only`` runs a
subset of the workloads.

The workers run on ``--loop`` (``auto``: uvloop when installed, as ``pgtask worker`` does); the
JSON's ``machine.uvloop`` says which uvloop was installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
from _server import libpq_url, psycopg_url, server
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

import sqlalchemy_pgtask
from sqlalchemy_pgtask import EnqueueRequest, enqueue, enqueue_many
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.testing import create_database, drop_database

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results.json"
QUEUE = "default"
TASKS_MODULE = "pgtask_bench_tasks"
#: Tasks due in an hour beside the due ones in the ``*_future`` workloads.
FUTURE = 200_000
#: Tasks in the ``*_10kb`` workloads (their payloads are ~10 KB each).
LARGE = 5000


def small_payload(i: int) -> dict[str, Any]:
    return {"i": i}


def large_payload(i: int) -> dict[str, Any]:
    """A ~10 KB order-like document (varied, so it compresses as real JSON does, ~3x)."""
    words = ("red", "blue", "large", "small", "boxed", "fragile", "gift", "express")
    return {
        "order": i,
        "items": [
            {
                "sku": f"{(i * 7919 + n * 104729) % 16**12:012x}",
                "qty": (i + n) % 9 + 1,
                "note": " ".join(words[(i + n * k) % len(words)] for k in range(8)),
            }
            for n in range(108)
        ],
    }

#: The worker's handlers. ``noop`` and ``noop_sync`` return ``time.time()`` taken when the
#: handler starts (the latency workload reads it back as the task's result).
TASKS_SOURCE = textwrap.dedent(
    '''
    """Handlers for benchmarks/run.py (written to a temporary directory)."""

    import atexit
    import os
    import time

    from sqlalchemy_pgtask import Registry

    registry = Registry()

    # Profile the worker's event loop thread from import (before the loop starts) to exit.
    _profile_path = os.environ.get("PGTASK_BENCH_CPROFILE")
    if _profile_path:
        import cProfile

        _profile = cProfile.Profile()
        _profile.enable()
        atexit.register(lambda: (_profile.disable(), _profile.dump_stats(_profile_path)))


    @registry.task("noop")
    async def noop(ctx, payload):
        return time.time()


    @registry.task("noop_sync")
    def noop_sync(ctx, payload):
        return time.time()
    '''
)

CLAIM_SQL = """
WITH picked AS (
    SELECT id FROM pgtask.tasks
    WHERE state = 'pending' AND queue = %(queue)s AND run_at <= statement_timestamp()
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
), claimed AS (
    UPDATE pgtask.tasks AS t
    SET state = 'running',
        attempt = t.attempt + 1,
        max_attempts = coalesce(t.max_attempts, 5),
        lease_token = gen_random_uuid(),
        lease_owner = %(worker)s,
        lease_expires_at = statement_timestamp() + interval '30 seconds',
        updated_at = statement_timestamp()
    WHERE t.id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING t.id, t.attempt, t.lease_token, t.payload
), recorded AS (
    INSERT INTO pgtask.attempts (task_id, attempt, lease_token, worker_id)
    SELECT id, attempt, lease_token, %(worker)s FROM claimed
)
SELECT id, attempt, lease_token, payload FROM claimed
"""

#: Its arrays go in psycopg's binary format, as the library's do (`sqlalchemy_pgtask._driver_sql`):
#: the text format's per-element quoting would slow the baseline, not the schema.
COMPLETE_SQL = """
WITH done AS (
    UPDATE pgtask.tasks AS t
    SET state = 'succeeded',
        result = r.result::jsonb,
        completed_at = statement_timestamp(),
        lease_token = NULL,
        lease_owner = NULL,
        lease_expires_at = NULL,
        updated_at = statement_timestamp()
    FROM unnest(%(ids)b::uuid[], %(attempts)b::int[], %(tokens)b::uuid[], %(results)b::text[])
        AS r(id, attempt, token, result)
    WHERE t.id = ANY (%(ids)b::uuid[])
      AND t.id = r.id
      AND t.state = %(running)s
      AND t.attempt = r.attempt
      AND t.lease_token = r.token
    RETURNING t.id, t.attempt
), recorded AS (
    UPDATE pgtask.attempts AS a
    SET state = 'succeeded', finished_at = statement_timestamp()
    FROM done
    WHERE a.task_id = done.id AND a.attempt = done.attempt
)
SELECT id FROM done
"""

INSERT_SQL = """
INSERT INTO pgtask.tasks
    (id, queue, name, version, payload, headers, priority, max_attempts, run_at)
VALUES (%s, %s, %s, 1, %s::jsonb, '{}'::jsonb, 0, 5, statement_timestamp())
"""


@dataclass(frozen=True)
class Config:
    single: int
    many: int
    many_batch: int
    drain: int
    latency: int
    latency_gap: float
    warmup: int


@dataclass(frozen=True)
class Bench:
    """What every workload needs: the database, an engine on it, and the worker's files."""

    url: str  # SQLAlchemy URL, psycopg 3 driver
    conninfo: str  # the same for libpq
    engine: Engine
    tasks_dir: Path
    config: Config
    py_spy: Path | None
    cprofile: Path | None
    loop: str  # the worker's --loop
    repeat_index: int
    horizon_wait: float


# -- helpers -----------------------------------------------------------------------------------


#: Transactions that hold back the cleanup horizon. A transaction with an xid in ANY database
#: of the cluster lowers the xmin of every snapshot taken meanwhile, so while it lasts no dead
#: row version left by claims and completions can be pruned or marked dead in an index: the
#: claim's index scan then walks every task claimed so far and drains slow down quadratically.
HORIZON_SQL = """
SELECT pid, datname, state, extract(epoch FROM now() - xact_start)::int AS seconds,
       left(query, 60) AS query
FROM pg_stat_activity
WHERE pid <> pg_backend_pid()
  AND xact_start < now() - make_interval(secs => %(seconds)s)
  AND (backend_xid IS NOT NULL OR (backend_xmin IS NOT NULL AND datname = current_database()))
UNION ALL
SELECT NULL, database, 'prepared', extract(epoch FROM now() - prepared)::int, gid
FROM pg_prepared_xacts
WHERE prepared < now() - make_interval(secs => %(seconds)s)
UNION ALL
SELECT NULL, database, 'replication slot', NULL, slot_name
FROM pg_replication_slots
WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
"""


def horizon_holders(conn: psycopg.Connection[Any], seconds: float) -> dict[str, str]:
    """Transactions older than ``seconds`` that hold back cleanup, by a stable key."""
    rows = conn.execute(HORIZON_SQL, {"seconds": seconds}).fetchall()
    return {
        f"{pid}/{db}/{query}": f"{state} transaction in database {db} (pid {pid}): {query}"
        for pid, db, state, _, query in rows
    }


@contextlib.contextmanager
def horizon_watch(bench: Bench, label: str) -> Iterator[dict[str, str]]:
    """Wait for a clean cleanup horizon, then record whoever holds it back during the block.

    Waits up to ``--horizon-wait`` seconds for transactions older than 2 s to end (other
    sessions on a shared server: tests, migrations). Yields a dict that collects every such
    transaction seen, polled every 0.5 s, while the workload runs.
    """
    seen: dict[str, str] = {}
    stop = threading.Event()
    with psycopg.connect(bench.conninfo, autocommit=True) as conn:
        deadline = time.monotonic() + bench.horizon_wait
        holders = horizon_holders(conn, 2.0)
        if holders:
            print(f"  {label}: waiting up to {bench.horizon_wait:.0f}s for old transactions to "
                  f"end: {'; '.join(holders.values())}", file=sys.stderr, flush=True)
        while holders and time.monotonic() < deadline:
            time.sleep(0.5)
            holders = horizon_holders(conn, 2.0)

        def poll() -> None:
            while True:
                seen.update(horizon_holders(conn, 2.0))
                if stop.wait(0.5):
                    return

        watcher = threading.Thread(target=poll, name="horizon-watch", daemon=True)
        watcher.start()
        try:
            yield seen
        finally:
            stop.set()
            watcher.join()
    if seen:
        print(f"  WARNING {label}: the cleanup horizon was held back while measuring by "
              f"{'; '.join(seen.values())}", file=sys.stderr, flush=True)


def reset(bench: Bench) -> None:
    """Empty the queue tables and leave them vacuumed, analysed and checkpointed."""
    with psycopg.connect(bench.conninfo, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE pgtask.tasks, pgtask.attempts, pgtask.idempotency_keys, pgtask.workers "
            "CASCADE"
        )
        conn.execute("VACUUM ANALYZE pgtask.tasks")
        conn.execute("VACUUM ANALYZE pgtask.attempts")
        with contextlib.suppress(psycopg.Error):  # needs superuser or pg_checkpoint
            conn.execute("CHECKPOINT")


def preload(
    bench: Bench, count: int, name: str, payload: Callable[[int], Any] = small_payload
) -> None:
    """Enqueue ``count`` tasks for ``name`` in batches of 1,000, then ANALYZE the table."""
    for start in range(0, count, 1000):
        with Session(bench.engine) as session:
            enqueue_many(
                session,
                [EnqueueRequest(name=name, payload=payload(i))
                 for i in range(start, min(count, start + 1000))],
            )
            session.commit()
    with psycopg.connect(bench.conninfo, autocommit=True) as conn:
        conn.execute("ANALYZE pgtask.tasks")


def outstanding(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pgtask.tasks WHERE state IN ('pending', 'running', 'waiting')"
    ).fetchone()
    assert row is not None
    return int(row[0])


def registered(conn: psycopg.Connection[Any], pid: int) -> bool:
    """The worker with this pid has written its row (it is about to claim)."""
    row = conn.execute("SELECT count(*) FROM pgtask.workers WHERE pid = %s", (pid,)).fetchone()
    return bool(row and row[0])


def drained_window(conn: psycopg.Connection[Any]) -> tuple[int, float]:
    """(succeeded tasks, seconds from first attempt start to last completion), database times."""
    row = conn.execute(
        """
        SELECT (SELECT count(*) FROM pgtask.tasks WHERE state = 'succeeded'),
               extract(epoch FROM (SELECT max(completed_at) FROM pgtask.tasks)
                                 - (SELECT min(started_at) FROM pgtask.attempts))
        """
    ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1] or 0.0)


def tasks_per_claim(conn: psycopg.Connection[Any]) -> float:
    """Mean attempts per claim statement: the attempts one claim inserts share its
    ``started_at`` (statement time)."""
    row = conn.execute(
        "SELECT count(*)::float8 / greatest(count(DISTINCT started_at), 1) FROM pgtask.attempts"
    ).fetchone()
    assert row is not None
    return float(row[0])


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (Linux ``/proc``); 0.0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _ticks()


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set so far (``VmHWM``), in MB (0 where not visible)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def postgres_cpu() -> float:
    """CPU seconds used so far by every live ``postgres`` process on this host (if visible)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
        except OSError:
            continue
        total += process_cpu(int(entry.name))
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs since boot, from ``/proc/stat`` (zeros elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = float(sum(fields[:8]))
    return total - idle, total


def worker_command(bench: Bench, concurrency: int) -> list[str]:
    script = Path(sys.executable).with_name("pgtask")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "sqlalchemy_pgtask.cli"]
    return [
        *head, "worker", f"{TASKS_MODULE}:registry", "--database-url", bench.url,
        "--concurrency", str(concurrency), "--log-level", "warning", "--loop", bench.loop,
    ]


@contextlib.contextmanager
def worker_process(bench: Bench, concurrency: int, label: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run one ``pgtask worker`` subprocess; stop it with SIGTERM (then harder) on exit."""
    log_path = bench.tasks_dir / f"{label}.r{bench.repeat_index}.log"
    # The caller's PYTHONPATH stays after the tasks module's: an A/B run can point it at
    # another checkout of the library.
    path = os.pathsep.join(p for p in (str(bench.tasks_dir), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    if bench.cprofile is not None:
        bench.cprofile.mkdir(parents=True, exist_ok=True)
        env["PGTASK_BENCH_CPROFILE"] = str(
            (bench.cprofile / f"{label}.r{bench.repeat_index}.prof").resolve()
        )
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            worker_command(bench, concurrency), cwd=bench.tasks_dir, env=env, stdout=log,
            stderr=subprocess.STDOUT,
        )
        spy: subprocess.Popen[bytes] | None = None
        if bench.py_spy is not None:
            bench.py_spy.mkdir(parents=True, exist_ok=True)
            out = bench.py_spy / f"{label}.r{bench.repeat_index}.txt"
            spy = subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(proc.pid),
                 "--rate", "250", "--format", "raw", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        try:
            yield proc
        finally:
            stop_process(proc)
            if spy is not None:
                try:
                    spy.wait(60)
                except subprocess.TimeoutExpired:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(30)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # drain: nothing is running, so this returns quickly
    try:
        proc.wait(40)
        return
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # second signal: hand back and stop now
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(bench: Bench, label: str, lines: int = 20) -> str:
    path = bench.tasks_dir / f"{label}.r{bench.repeat_index}.log"
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def wait_until(
    check: Callable[[], bool], deadline: float, proc: subprocess.Popen[bytes] | None,
    what: str, interval: float = 0.2,
) -> None:
    while not check():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(interval)


# -- workloads ---------------------------------------------------------------------------------


def baseline_insert(bench: Bench) -> dict[str, Any]:
    """Raw psycopg: one INSERT and one COMMIT per task, on one connection."""
    reset(bench)
    n = bench.config.single
    with psycopg.connect(bench.conninfo) as conn:
        for i in range(bench.config.warmup):
            conn.execute(INSERT_SQL, (uuid.uuid4(), QUEUE, "noop", json.dumps({"i": -i})))
            conn.commit()
        start = time.perf_counter()
        cpu0 = time.process_time()
        for i in range(n):
            conn.execute(INSERT_SQL, (uuid.uuid4(), QUEUE, "noop", json.dumps({"i": i})))
            conn.commit()
        cpu = time.process_time() - cpu0
        seconds = time.perf_counter() - start
    return {
        "value": n / seconds, "unit": "tasks/s", "tasks": n, "seconds": seconds,
        "client_cpu_us_per_task": cpu / n * 1e6,
    }


def _single_loop(bench: Bench, one: Callable[[int], None]) -> dict[str, Any]:
    """Warm up, then time ``bench.config.single`` calls of ``one`` (each enqueues and commits)."""
    reset(bench)
    n = bench.config.single
    for i in range(bench.config.warmup):
        one(-i)
    start = time.perf_counter()
    cpu0 = time.process_time()
    for i in range(n):
        one(i)
    cpu = time.process_time() - cpu0
    seconds = time.perf_counter() - start
    return {
        "value": n / seconds, "unit": "tasks/s", "tasks": n, "seconds": seconds,
        "client_cpu_us_per_task": cpu / n * 1e6,
    }


def enqueue_single(bench: Bench) -> dict[str, Any]:
    """`enqueue` + commit per task on one held connection: the raw loop's shape."""
    with bench.engine.connect() as connection:

        def one(i: int) -> None:
            enqueue(connection, "noop", {"i": i})
            connection.commit()

        return _single_loop(bench, one)


def enqueue_single_session(bench: Bench) -> dict[str, Any]:
    """One `enqueue` per new `Session` (pool checkout, transaction, commit, close)."""

    def one(i: int) -> None:
        with Session(bench.engine) as session:
            enqueue(session, "noop", {"i": i})
            session.commit()

    return _single_loop(bench, one)


def enqueue_many_workload(
    bench: Bench, n: int | None = None, payload: Callable[[int], Any] = small_payload
) -> dict[str, Any]:
    """`enqueue_many` of ``n`` tasks (``many``) in batches of ``many_batch``, each batch its
    own transaction; the payloads are built before the clock starts."""
    reset(bench)
    n, batch = n or bench.config.many, bench.config.many_batch
    with Session(bench.engine) as session:  # warm the compiled cache and the pool
        enqueue_many(session, [EnqueueRequest(name="noop", payload=payload(-1))])
        session.commit()
    payloads = [payload(i) for i in range(n)]
    start = time.perf_counter()
    cpu0 = time.process_time()
    for first in range(0, n, batch):
        with Session(bench.engine) as session:
            enqueue_many(
                session,
                [EnqueueRequest(name="noop", payload=payloads[i])
                 for i in range(first, min(n, first + batch))],
            )
            session.commit()
    cpu = time.process_time() - cpu0
    seconds = time.perf_counter() - start
    return {
        "value": n / seconds, "unit": "tasks/s", "tasks": n, "seconds": seconds,
        "client_cpu_us_per_task": cpu / n * 1e6,
    }


def baseline_copy(bench: Bench) -> dict[str, Any]:
    """Raw psycopg: ``COPY`` of ``many_batch`` rows + ``COMMIT`` per batch, one connection."""
    reset(bench)
    n, batch = bench.config.many, bench.config.many_batch
    command = (
        "COPY pgtask.tasks (id, queue, name, version, payload, headers, priority) FROM STDIN"
    )
    with psycopg.connect(bench.conninfo) as conn:
        start = time.perf_counter()
        cpu0 = time.process_time()
        for first in range(0, n, batch):
            with conn.cursor() as cursor, cursor.copy(command) as copy:
                for i in range(first, min(n, first + batch)):
                    copy.write_row(
                        (uuid.uuid4(), QUEUE, "noop", 1, json.dumps({"i": i}), "{}", 0)
                    )
            conn.commit()
        cpu = time.process_time() - cpu0
        seconds = time.perf_counter() - start
    return {
        "value": n / seconds, "unit": "tasks/s", "tasks": n, "seconds": seconds,
        "client_cpu_us_per_task": cpu / n * 1e6,
    }


def baseline_claim_complete(bench: Bench, batch: int = 100) -> dict[str, Any]:
    """One raw autocommit connection: claim up to ``batch``, complete them, until empty."""
    reset(bench)
    n = bench.config.drain
    preload(bench, n, "noop")
    worker = uuid.uuid4()
    statements = 0
    with psycopg.connect(bench.conninfo, autocommit=True) as conn:
        start = time.perf_counter()
        cpu0 = postgres_cpu()
        while True:
            rows = conn.execute(
                CLAIM_SQL, {"queue": QUEUE, "limit": batch, "worker": worker}
            ).fetchall()
            if not rows:
                break
            done = conn.execute(
                COMPLETE_SQL,
                {
                    "ids": [r[0] for r in rows],
                    "attempts": [r[1] for r in rows],
                    "tokens": [r[2] for r in rows],
                    "results": [json.dumps(time.time())] * len(rows),
                    "running": "running",
                },
            ).fetchall()
            statements += 2
            if len(done) != len(rows):
                raise RuntimeError(f"completed {len(done)} of {len(rows)} claimed tasks")
        wall = time.perf_counter() - start
        server_cpu = postgres_cpu() - cpu0
        succeeded, seconds = drained_window(conn)
    if succeeded != n:
        raise RuntimeError(f"baseline_claim_complete({batch}): {succeeded} of {n} succeeded")
    return {
        "value": n / seconds, "unit": "tasks/s", "tasks": n, "seconds": seconds,
        "wall_seconds": wall, "statements": statements,
        "server_cpu_us_per_task": server_cpu / n * 1e6,
    }


def add_future(bench: Bench, count: int, name: str) -> None:
    """``count`` pending tasks for ``name`` due in an hour, then VACUUM ANALYZE (as `reset`
    leaves the table for the workloads without them, so autovacuum does not start mid-run).

    Inserted 20,000 per transaction: a longer one would be flagged as holding the horizon.
    """
    with psycopg.connect(bench.conninfo, autocommit=True) as conn:
        for first in range(0, count, 20_000):
            conn.execute(
                "INSERT INTO pgtask.tasks (queue, name, payload, run_at) "
                "SELECT %s, %s, jsonb_build_object('future', g), "
                "statement_timestamp() + interval '1 hour' "
                "FROM generate_series(%s::int, %s::int) AS g",
                (QUEUE, name, first + 1, min(count, first + 20_000)),
            )
        conn.execute("VACUUM ANALYZE pgtask.tasks")


def drain(
    bench: Bench, label: str, name: str, concurrency: int, future: int = 0,
    n: int | None = None, payload: Callable[[int], Any] = small_payload,
) -> dict[str, Any]:
    """Pre-enqueue ``n`` (``drain``) tasks for handler ``name`` (and ``future`` tasks due in
    an hour); one worker drains the due ones."""
    reset(bench)
    n = n or bench.config.drain
    preload(bench, n, name, payload)
    if future:
        add_future(bench, future, name)
    with psycopg.connect(bench.conninfo, autocommit=True) as conn:
        started = time.monotonic()
        with worker_process(bench, concurrency, label) as proc:
            try:
                # CPU is counted from registration on, so imports and start-up are excluded.
                wait_until(
                    lambda: registered(conn, proc.pid), started + 60, proc,
                    f"{label} to register", interval=0.005,
                )
                worker_cpu0, server_cpu0 = process_cpu(proc.pid), postgres_cpu()
                wait_until(
                    lambda: outstanding(conn) == future, started + 60 + n / 50, proc,
                    f"{label} to drain {n} tasks", interval=0.25,
                )
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{log_tail(bench, label)}") from None
            worker_cpu = process_cpu(proc.pid) - worker_cpu0
            server_cpu = postgres_cpu() - server_cpu0
            rss = peak_rss_mb(proc.pid)
        succeeded, seconds = drained_window(conn)
        per_claim = tasks_per_claim(conn)
    if succeeded != n:
        raise RuntimeError(f"{label}: {succeeded} of {n} succeeded\n{log_tail(bench, label)}")
    return {
        "value": n / seconds, "unit": "tasks/s", "tasks": n, "seconds": seconds,
        "worker_cpu_us_per_task": worker_cpu / n * 1e6,
        "server_cpu_us_per_task": server_cpu / n * 1e6,
        "cpu_us_per_task": (worker_cpu + server_cpu) / n * 1e6,
        "tasks_per_claim": per_claim,
        "worker_peak_rss_mb": rss,
    }


def latency(bench: Bench, future: int = 0) -> dict[str, Any]:
    """Enqueue-to-handler-start latency against an idle worker (concurrency 10), with
    ``future`` tasks due in an hour in the same queue; PostgreSQL CPU per wake-up."""
    reset(bench)
    config = bench.config
    label = "latency_future" if future else "latency"
    if future:
        add_future(bench, future, "noop")
    with psycopg.connect(bench.conninfo, autocommit=True) as conn, worker_process(
        bench, 10, label
    ) as proc:

        wait_until(
            lambda: registered(conn, proc.pid), time.monotonic() + 60, proc,
            "the worker to register",
        )
        time.sleep(1.0)  # its claim loop has run once and is now asleep
        committed: dict[uuid.UUID, float] = {}
        total = config.warmup + config.latency
        server_cpu0 = 0.0
        next_at = time.monotonic()
        for i in range(total):
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at += config.latency_gap
            with Session(bench.engine) as session:
                result = enqueue(session, "noop", {"i": i})
                session.commit()
                done = time.time()
            if i == config.warmup - 1:
                server_cpu0 = postgres_cpu()
            if i >= config.warmup:  # the first tasks warm statement caches and plans
                committed[result.id] = done

        def finished() -> bool:
            return outstanding(conn) == future

        try:
            wait_until(finished, time.monotonic() + 60, proc, "the latency tasks to finish")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{log_tail(bench, label)}") from None
        # Includes the producer's enqueue transactions, the same in both workloads.
        server_cpu = postgres_cpu() - server_cpu0
        rows = conn.execute(
            "SELECT id, result, state FROM pgtask.tasks WHERE id = ANY(%s)", (list(committed),)
        ).fetchall()
    if len(rows) != len(committed) or any(r[2] != "succeeded" for r in rows):
        raise RuntimeError("latency: not every task succeeded")
    millis = sorted((float(r[1]) - committed[r[0]]) * 1000.0 for r in rows)
    cuts = statistics.quantiles(millis, n=100, method="inclusive")
    return {
        "value": cuts[49], "unit": "ms (p50)", "p50_ms": cuts[49], "p95_ms": cuts[94],
        "p99_ms": cuts[98], "max_ms": millis[-1], "min_ms": millis[0], "tasks": len(millis),
        "server_cpu_us_per_task": server_cpu / len(millis) * 1e6,
    }


WORKLOADS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "baseline_insert": baseline_insert,
    "enqueue_single": enqueue_single,
    "enqueue_single_session": enqueue_single_session,
    "enqueue_many": enqueue_many_workload,
    "baseline_copy": baseline_copy,
    "baseline_claim_complete": baseline_claim_complete,
    # Not a target: the same raw loop with batches of 10, the most a worker at concurrency 10
    # can claim at once; it shows what the schema allows per statement at that batch size.
    "baseline_claim_complete_b10": lambda b: baseline_claim_complete(b, 10),
    "drain_c10_async": lambda b: drain(b, "drain_c10_async", "noop", 10),
    "drain_c100_async": lambda b: drain(b, "drain_c100_async", "noop", 100),
    "drain_c10_sync": lambda b: drain(b, "drain_c10_sync", "noop_sync", 10),
    "drain_c100_sync": lambda b: drain(b, "drain_c100_sync", "noop_sync", 100),
    "latency": latency,
    # Future work costs nothing: the same with FUTURE tasks due in an hour in the queue.
    "drain_c100_future": lambda b: drain(b, "drain_c100_future", "noop", 100, FUTURE),
    "latency_future": lambda b: latency(b, FUTURE),
    # Payloads of ~10 KB (TOAST-compressed), against the small ones of the same workloads.
    "enqueue_many_10kb": lambda b: enqueue_many_workload(b, LARGE, large_payload),
    "drain_c100_10kb": lambda b: drain(
        b, "drain_c100_10kb", "noop", 100, n=LARGE, payload=large_payload
    ),
    # The worker's memory: its peak resident set draining 50,000 tasks at concurrency 100.
    "drain_c100_50k": lambda b: drain(b, "drain_c100_50k", "noop", 100, n=50_000),
}


# -- targets -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    label: str
    numerator: str  # "workload" or "workload.field"
    denominator: str | None
    bound: float
    at_least: bool  # True: value >= bound passes; False: value <= bound passes


#: Printed for reading the figures, never judged.
INFO = (
    ("enqueue_many / baseline_copy", "enqueue_many", "baseline_copy"),
    ("enqueue_single_session / baseline_insert", "enqueue_single_session", "baseline_insert"),
    ("drain_c10_async / baseline_claim_complete_b10", "drain_c10_async",
     "baseline_claim_complete_b10"),
    ("baseline_claim_complete_b10 / baseline_claim_complete", "baseline_claim_complete_b10",
     "baseline_claim_complete"),
    ("drain_c100_sync / drain_c100_async", "drain_c100_sync", "drain_c100_async"),
    ("enqueue_many_10kb / enqueue_many", "enqueue_many_10kb", "enqueue_many"),
    ("drain_c100_10kb / drain_c100_async", "drain_c100_10kb", "drain_c100_async"),
)

TARGETS = (
    Target("drain_c100_async / baseline_claim_complete", "drain_c100_async",
           "baseline_claim_complete", 0.9, at_least=True),
    Target("drain_c10_async / baseline_claim_complete", "drain_c10_async",
           "baseline_claim_complete", 0.6, at_least=True),
    Target("CPU us per task at c100 (worker + PostgreSQL)", "drain_c100_async.cpu_us_per_task",
           None, 110.0, at_least=False),
    Target("enqueue_single / baseline_insert", "enqueue_single", "baseline_insert", 0.9,
           at_least=True),
    Target("enqueue_many tasks/s", "enqueue_many", None, 60_000.0, at_least=True),
    Target("latency p50 ms", "latency.p50_ms", None, 1.2, at_least=False),
    Target("latency p99 ms", "latency.p99_ms", None, 2.5, at_least=False),
    Target("drain_c100_future / drain_c100_async", "drain_c100_future", "drain_c100_async",
           0.9, at_least=True),
    Target("latency_future p50 / latency p50", "latency_future.p50_ms", "latency.p50_ms", 1.2,
           at_least=False),
    Target("PostgreSQL CPU per wake-up, future / none", "latency_future.server_cpu_us_per_task",
           "latency.server_cpu_us_per_task", 1.2, at_least=False),
    Target("worker peak RSS MB, 50,000 tasks at c100", "drain_c100_50k.worker_peak_rss_mb",
           None, 150.0, at_least=False),
)


def _lookup(run: dict[str, dict[str, Any]], ref: str) -> float | None:
    workload, _, key = ref.partition(".")
    figures = run.get(workload)
    if figures is None or "error" in figures:
        return None
    return float(figures[key or "value"])


def ratios(runs: list[dict[str, dict[str, Any]]], num: str, den: str) -> list[float]:
    values = []
    for run in runs:
        a, b = _lookup(run, num), _lookup(run, den)
        if a is not None and b:
            values.append(a / b)
    return values


def evaluate(runs: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each target's value per repeat (ratios within a repeat) and the median's verdict."""
    verdicts: list[dict[str, Any]] = []
    for target in TARGETS:
        values = []
        for run in runs:
            num = _lookup(run, target.numerator)
            den = _lookup(run, target.denominator) if target.denominator else 1.0
            if num is not None and den:
                values.append(num / den)
        if not values:
            verdicts.append({"target": target.label, "status": "NOT RUN"})
            continue
        value = statistics.median(values)
        passed = value >= target.bound if target.at_least else value <= target.bound
        margin = (value - target.bound) if target.at_least else (target.bound - value)
        verdicts.append({
            "target": target.label,
            "bound": f"{'>=' if target.at_least else '<='} {target.bound:g}",
            "median": value,
            "values": values,
            "status": "PASS" if passed else "MISS",
            "margin_pct": margin / target.bound * 100.0,
        })
    return verdicts


# -- reporting ---------------------------------------------------------------------------------


def medians(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in WORKLOADS:
        done = [run[name] for run in runs if name in run and "error" not in run[name]]
        if not done:
            continue
        summary: dict[str, Any] = {"unit": done[0]["unit"], "repeats": len(done)}
        for key, first in done[0].items():
            if isinstance(first, (int, float)) and not isinstance(first, bool):
                summary[key] = statistics.median(float(d[key]) for d in done)
        summary["values"] = [d["value"] for d in done]
        summary["horizon_held_runs"] = sum(1 for d in done if d.get("horizon_held_by"))
        out[name] = summary
    return out


def _fmt(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def info_ratios(runs: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for label, num, den in INFO:
        values = ratios(runs, num, den)
        if values:
            out.append({"ratio": label, "median": statistics.median(values), "values": values})
    return out


def print_table(
    summary: dict[str, dict[str, Any]], verdicts: list[dict[str, Any]],
    info: list[dict[str, Any]],
) -> None:
    rows = [("workload", "median", "unit", "per repeat", "notes")]
    for name, figures in summary.items():
        notes = []
        if "p95_ms" in figures:
            notes.append(f"p95 {figures['p95_ms']:.2f} p99 {figures['p99_ms']:.2f} ms")
        if "worker_cpu_us_per_task" in figures:
            notes.append(f"worker {figures['worker_cpu_us_per_task']:.0f} us/task")
        if figures.get("worker_peak_rss_mb"):
            notes.append(f"RSS {figures['worker_peak_rss_mb']:.0f} MB")
        if "server_cpu_us_per_task" in figures:
            notes.append(f"postgres {figures['server_cpu_us_per_task']:.0f} us/task")
        if "host_cpu_busy_pct" in figures:
            notes.append(f"host busy {figures['host_cpu_busy_pct']:.0f}%")
        if figures["horizon_held_runs"]:
            notes.append(
                f"HORIZON HELD in {figures['horizon_held_runs']}/{figures['repeats']} runs"
            )
        rows.append((
            name, _fmt(figures["value"]), figures["unit"],
            " ".join(_fmt(v) for v in figures["values"]), ", ".join(notes),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print()
    for v in verdicts:
        if v["status"] == "NOT RUN":
            print(f"NOT RUN  {v['target']}")
            continue
        per = " ".join(_fmt(x) for x in v["values"])
        print(
            f"{v['status']:<5} {v['target']}: {_fmt(v['median'])} (target {v['bound']}; "
            f"margin {v['margin_pct']:+.0f}%; per repeat {per})"
        )
    for i in info:
        per = " ".join(_fmt(x) for x in i["values"])
        print(f"info  {i['ratio']}: {_fmt(i['median'])} (per repeat {per})")
    print()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(bench_url: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "sqlalchemy_pgtask": sqlalchemy_pgtask.__version__,
        "uvloop": _version("uvloop"),
    }
    with psycopg.connect(libpq_url(bench_url)) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        info["postgresql"] = row[0] if row else None
        info["settings"] = dict(
            conn.execute(
                "SELECT name, current_setting(name) FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'shared_buffers', 'full_page_writes', "
                "'max_connections', 'plan_cache_mode')"
            ).fetchall()
        )
    return info


# -- main --------------------------------------------------------------------------------------


def run(server_url: str, args: argparse.Namespace, config: Config) -> dict[str, Any]:
    database = create_database(psycopg_url(server_url), "pgtask_bench")
    engine = create_engine(database)
    selected = [w.strip() for w in args.only.split(",")] if args.only else list(WORKLOADS)
    unknown = set(selected) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workload(s): {', '.join(sorted(unknown))}")
    runs: list[dict[str, dict[str, Any]]] = []
    try:
        upgrade(database)
        with tempfile.TemporaryDirectory(prefix="pgtask-bench-") as tmp:
            tasks_dir = Path(tmp)
            (tasks_dir / f"{TASKS_MODULE}.py").write_text(TASKS_SOURCE)
            for index in range(args.repeat):
                bench = Bench(
                    url=database, conninfo=libpq_url(database), engine=engine,
                    tasks_dir=tasks_dir, config=config, py_spy=args.py_spy, cprofile=args.cprofile,
                    loop=args.loop, repeat_index=index, horizon_wait=args.horizon_wait,
                )
                figures: dict[str, dict[str, Any]] = {}
                for name in selected:
                    print(f"[repeat {index + 1}/{args.repeat}] {name} ...", file=sys.stderr,
                          flush=True)
                    try:
                        with horizon_watch(bench, name) as holders:
                            busy0, total0 = machine_busy()
                            figures[name] = WORKLOADS[name](bench)
                            busy1, total1 = machine_busy()
                    except Exception as exc:
                        print(f"  {name} failed: {exc}", file=sys.stderr, flush=True)
                        figures[name] = {"error": str(exc)}
                        continue
                    result = figures[name]
                    result["horizon_held_by"] = sorted(holders.values())
                    if total1 > total0:  # every process on the host, this run included
                        result["host_cpu_busy_pct"] = (busy1 - busy0) / (total1 - total0) * 100
                    result["load_average_1m"] = os.getloadavg()[0]
                    print(f"  {_fmt(result['value'])} {result['unit']}", file=sys.stderr,
                          flush=True)
                runs.append(figures)
        info = machine(database)
    finally:
        engine.dispose()
        drop_database(database)
    summary = medians(runs)
    verdicts = evaluate(runs)
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": info,
        "config": config.__dict__,
        "repeats": args.repeat,
        "medians": summary,
        "targets": verdicts,
        "info": info_ratios(runs),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", metavar="URL",
                        help="a server where CREATE DATABASE works (default: provide_server)")
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="run every workload K times and report medians (1)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, metavar="PATH",
                        help=f"where to write the JSON results ({DEFAULT_JSON})")
    parser.add_argument("--only", metavar="NAMES",
                        help="comma-separated workloads to run (default: all)")
    parser.add_argument("--horizon-wait", type=float, default=120.0, metavar="SECONDS",
                        help="before each workload, wait this long for transactions older than "
                        "2 s (in any database) to end; they disable dead-row cleanup (120)")
    parser.add_argument("--py-spy", type=Path, metavar="DIR",
                        help="record every worker with py-spy into DIR")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="the workers' event loop, as pgtask worker --loop (auto)")
    parser.add_argument("--cprofile", type=Path, metavar="DIR",
                        help="profile every worker's event loop with cProfile into DIR/*.prof")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    config = Config(
        single=500 if args.quick else 2000,
        many=20_000,
        many_batch=1000,
        drain=5000 if args.quick else 20_000,
        latency=200,
        latency_gap=0.020,
        warmup=20,
    )
    started = time.monotonic()
    with server(args.database_url) as found:
        document = run(found.url, args, config)
        document["server"] = found.description
    document["elapsed_seconds"] = time.monotonic() - started
    print_table(document["medians"], document["targets"], document["info"])
    text = json.dumps(document, indent=2, default=str)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
