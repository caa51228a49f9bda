"""benchmarks/payload_costs.py: what ~10 KB payloads cost PostgreSQL, and which part costs what.

::

    .venv/bin/python benchmarks/payload_costs.py [--database-url URL] [--tasks N] [--repeat K]
        [--payload large|small]

Creates one throwaway database per variant of the schema, then in each, ``--repeat`` times:
``COPY`` of ``N`` tasks (batches of 1,000, rows preformatted before the clock starts, so the
figure is PostgreSQL's work, not the client's) with the payloads of ``run.py``'s ``*_10kb``
workloads (``--payload small``: those of the others), then the raw claim + complete loop with
the library's own ``CLAIM`` and ``COMPLETE`` (batches of 100) until they are drained. Prints
tasks/s and all PostgreSQL processes' CPU per task for each, and the table's size after the
``COPY`` (medians of the repeats; variants are interleaved per repeat, so the host's swings
shake them alike).

The variants take one thing away from the schema of revision ``pgtask_0007`` at a time, or
show an older revision:

* ``0007``: the six CHECK constraints on names and JSON sizes, pglz (as before ``pgtask_0008``);
* ``0007, no triggers``: its user triggers disabled (capacity admission, notifications);
* ``0007, no JSON/name CHECKs``: those six constraints dropped;
* ``0007, lz4``: payload compressed with lz4 (where the server has it);
* ``0007, uncompressed``: payload stored out of line without compression (``STORAGE EXTERNAL``);
* ``0008``: with the attempts' foreign key to their task (as before ``pgtask_0009``);
* ``head``: the shipped revisions (the checks as column triggers, lz4 where available).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

import explain_hot
import run as bench_run
from _server import libpq_url, psycopg_url, server

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.enqueue.plan import new_ids
from sqlalchemy_pgtask.migrations import HEAD, upgrade
from sqlalchemy_pgtask.testing import create_database, drop_database

_CHECKS = (
    "ck_tasks_name", "ck_tasks_queue", "ck_tasks_payload_size", "ck_tasks_headers",
    "ck_tasks_result_size", "ck_tasks_error_size",
)
#: (label, revision, statements run after it).
VARIANTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("0007", "pgtask_0007", ()),
    ("0007, no triggers", "pgtask_0007", ("ALTER TABLE pgtask.tasks DISABLE TRIGGER USER",)),
    ("0007, no JSON/name CHECKs", "pgtask_0007", tuple(
        f"ALTER TABLE pgtask.tasks DROP CONSTRAINT {name}" for name in _CHECKS
    )),
    ("0007, lz4", "pgtask_0007",
     ("ALTER TABLE pgtask.tasks ALTER COLUMN payload SET COMPRESSION lz4",)),
    ("0007, uncompressed", "pgtask_0007",
     ("ALTER TABLE pgtask.tasks ALTER COLUMN payload SET STORAGE EXTERNAL",)),
    ("0008", "pgtask_0008", ()),
    ("head", HEAD, ()),
)
_COPY = "COPY pgtask.tasks (id, queue, name, version, payload, headers, priority) FROM STDIN"


def _batches(count: int, payload: str) -> list[bytes]:
    """``COPY`` text of ``count`` tasks in batches of 1,000 (the payload text has no tab,
    newline or backslash, so it needs no escaping)."""
    make = bench_run.large_payload if payload == "large" else bench_run.small_payload
    payloads = [json.dumps(make(i)) for i in range(200)]
    assert not any(c in p for p in payloads for c in "\t\n\\")
    batches = []
    for first in range(0, count, 1000):
        size = min(1000, count - first)
        ids = new_ids(size)
        batches.append("".join(
            f"{ids[i]}\tdefault\tnoop\t1\t{payloads[(first + i) % 200]}\t{{}}\t0\n"
            for i in range(size)
        ).encode())
    return batches


def measure(conninfo: str, count: int, payload: str) -> dict[str, float]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for name, value in (("enable_seqscan", "off"), ("plan_cache_mode", "force_generic_plan"),
                            ("jit", "off")):
            conn.execute(f"SET {name} = {value}")
        conn.execute("TRUNCATE pgtask.tasks, pgtask.attempts CASCADE")
        conn.execute("CHECKPOINT")
        batches = _batches(count, payload)
        cpu0, start = bench_run.postgres_cpu(), time.perf_counter()
        for batch in batches:
            with conn.transaction(), conn.cursor() as cursor, cursor.copy(_COPY) as copy:
                copy.write(batch)
        copy_seconds, copy_cpu = time.perf_counter() - start, bench_run.postgres_cpu() - cpu0
        size = conn.execute("SELECT pg_total_relation_size('pgtask.tasks')").fetchone()
        conn.execute("VACUUM ANALYZE pgtask.tasks")
        conn.execute("VACUUM ANALYZE pgtask.attempts")
        worker, done = uuid.uuid4(), 0
        cpu0, start = bench_run.postgres_cpu(), time.perf_counter()
        while rows := explain_hot.execute(
            conn, statements.CLAIM, explain_hot.claim_params(100, worker)
        ):
            explain_hot.execute(conn, statements.COMPLETE, dict(statements.complete_params(
                explain_hot.leases(rows), ["null"] * len(rows)
            )))
            done += len(rows)
        drain_seconds, drain_cpu = time.perf_counter() - start, bench_run.postgres_cpu() - cpu0
    assert done == count, (done, count)
    return {
        "copy_per_s": count / copy_seconds, "copy_cpu_us": copy_cpu / count * 1e6,
        "drain_per_s": count / drain_seconds, "drain_cpu_us": drain_cpu / count * 1e6,
        "table_mb": (size[0] if size else 0) / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", metavar="URL")
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--payload", choices=("large", "small"), default="large")
    args = parser.parse_args(argv)
    with server(args.database_url) as found:
        show(found.url, args)
    return 0


def show(server_url: str, args: argparse.Namespace) -> None:
    databases: list[tuple[str, str]] = []
    try:
        for label, revision, ddl in VARIANTS:
            url = create_database(psycopg_url(server_url), "pgtask_payload")
            databases.append((label, url))
            upgrade(url, revision)
            conninfo = libpq_url(url)
            with psycopg.connect(conninfo, autocommit=True) as conn:
                for statement in ddl:
                    try:
                        conn.execute(statement)
                    except psycopg.errors.FeatureNotSupported as exc:
                        print(f"{label}: skipped ({exc})", file=sys.stderr)
        results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in databases}
        for repeat in range(args.repeat):
            for label, url in databases:
                print(f"[repeat {repeat + 1}/{args.repeat}] {label} ...", file=sys.stderr)
                results[label].append(measure(libpq_url(url), args.tasks, args.payload))
    finally:
        for _, url in databases:
            drop_database(url)
    size = "~10 KB" if args.payload == "large" else "small payloads"
    print(f"\n{args.tasks} tasks of {size}; medians of {args.repeat}; PostgreSQL CPU per task\n")
    print(f"{'variant':28} {'COPY tasks/s':>13} {'CPU us':>8} {'drain tasks/s':>14} {'CPU us':>8}"
          f" {'table MB':>9}")
    for label, runs in results.items():
        median: dict[str, Any] = {
            key: statistics.median(r[key] for r in runs) for key in runs[0]
        }
        print(f"{label:28} {median['copy_per_s']:13,.0f} {median['copy_cpu_us']:8.0f}"
              f" {median['drain_per_s']:14,.0f} {median['drain_cpu_us']:8.0f}"
              f" {median['table_mb']:9.0f}")


if __name__ == "__main__":
    sys.exit(main())
