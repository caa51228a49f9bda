"""benchmarks/statement_cpu.py: PostgreSQL CPU per task of the worker's CLAIM and COMPLETE.

::

    .venv/bin/python benchmarks/statement_cpu.py [--database-url URL] [--rounds R]
        [--batch B] [--batches K]

The drain workloads of ``run.py`` count the CPU of every PostgreSQL process over a whole
drain (the walwriter, autovacuum, heartbeats), so the figure for one statement is lost among
the rest. This script runs the statements alone on one held autocommit connection (the
worker's planner settings on it) in a throwaway database (``--database-url``, else the server
``benchmarks/_server.py`` finds) and reads that backend's own CPU time from ``/proc`` before
and after: per round, for the library's statements and then for ``run.py``'s raw baseline
(``CLAIM_SQL``, ``COMPLETE_SQL``) in turn, it enqueues ``B * K`` tasks, claims them in ``K``
claims of ``B``, then completes them in ``K`` statements. It prints each round's microseconds
of backend CPU per task and the medians over ``--rounds`` (default 5).

The server must run on this host (``/proc/<backend pid>``). Both sides share the schema: the
difference is what the library's statements do beyond the raw ones (capability arrays, the
policy snapshot, deadlines, the ``SKIP LOCKED`` pass of COMPLETE, cancellation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from _server import scratch_database
from run import CLAIM_SQL, COMPLETE_SQL
from sqlalchemy import Connection, create_engine, text

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._driver_sql import execute
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements import Capability, Lease
from sqlalchemy_pgtask.worker._reconnect import PLANNER_SETTINGS

_TICKS = os.sysconf("SC_CLK_TCK")
_ENQUEUE = (
    "INSERT INTO pgtask.tasks (id, queue, name, payload)"
    " SELECT gen_random_uuid(), 'default', 'noop', jsonb_build_object('i', i)"
    " FROM generate_series(1, %s) AS i"
)

Claim = Callable[[int], list[Lease]]
Complete = Callable[[Sequence[Lease]], None]


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def library(conn: Connection) -> tuple[Claim, Complete]:
    capabilities = statements.capability_params(
        ["default"], [Capability("default", "noop", 1, RetryPolicy.fixed(1.0), 5)]
    )
    worker = uuid.uuid4()

    def claim(limit: int) -> list[Lease]:
        params = statements.claim_params(
            capabilities, worker_id=worker, lease_seconds=30.0, limit=limit
        )
        rows = execute(conn, statements.CLAIM, params).all()
        return [Lease(row.id, row.attempt, row.lease_token) for row in rows]

    def complete(leases: Sequence[Lease]) -> None:
        params = statements.complete_params(leases, ["1.5"] * len(leases))
        execute(conn, statements.COMPLETE, params).all()

    return claim, complete


def raw(driver: psycopg.Connection[Any]) -> tuple[Claim, Complete]:
    worker = uuid.uuid4()

    def claim(limit: int) -> list[Lease]:
        rows = driver.execute(
            CLAIM_SQL, {"queue": "default", "limit": limit, "worker": worker}
        ).fetchall()
        return [Lease(row[0], row[1], row[2]) for row in rows]

    def complete(leases: Sequence[Lease]) -> None:
        driver.execute(COMPLETE_SQL, {
            "ids": [lease.task_id for lease in leases],
            "attempts": [lease.attempt for lease in leases],
            "tokens": [lease.token for lease in leases],
            "results": ["1.5"] * len(leases),
            "running": "running",
        }).fetchall()

    return claim, complete


def measure(
    conn: Connection, pid: int, sides: tuple[Claim, Complete], batch: int, batches: int
) -> tuple[float, float]:
    """Backend CPU per task (us) of ``batches`` claims of ``batch``, then of their completions."""
    claim, complete = sides
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    driver.execute(_ENQUEUE, (batch * batches,))
    driver.execute("ANALYZE pgtask.tasks")
    before = backend_cpu(pid)
    claimed = [claim(batch) for _ in range(batches)]
    between = backend_cpu(pid)
    for leases in claimed:
        complete(leases)
    after = backend_cpu(pid)
    count = sum(len(leases) for leases in claimed)
    assert count == batch * batches, f"claimed {count} of {batch * batches}"
    return (between - before) / count * 1e6, (after - between) / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", metavar="URL")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--batches", type=int, default=50)
    args = parser.parse_args(argv)
    figures: dict[str, list[tuple[float, float]]] = {"library": [], "raw": []}
    with scratch_database(args.database_url, "pgtask_statement_cpu") as url:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                for name, value in PLANNER_SETTINGS:
                    conn.execute(text("SELECT set_config(:name, :value, false)"),
                                 {"name": name, "value": value})
                pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                driver = conn.connection.driver_connection
                assert isinstance(driver, psycopg.Connection)
                sides = {"library": library(conn), "raw": raw(driver)}
                print(f"backend CPU, us per task; claims and completions of {args.batch}")
                for round_ in range(1, args.rounds + 1):
                    for name, side in sides.items():
                        claim_us, complete_us = measure(
                            conn, pid, side, args.batch, args.batches
                        )
                        figures[name].append((claim_us, complete_us))
                        print(f"round {round_} {name:8} CLAIM {claim_us:6.1f}"
                              f"  COMPLETE {complete_us:6.1f}", flush=True)
        finally:
            engine.dispose()
    print()
    for name, pairs in figures.items():
        claim_us = statistics.median(pair[0] for pair in pairs)
        complete_us = statistics.median(pair[1] for pair in pairs)
        print(f"median   {name:8} CLAIM {claim_us:6.1f}  COMPLETE {complete_us:6.1f}"
              f"  both {claim_us + complete_us:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
