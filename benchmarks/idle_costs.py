"""benchmarks/idle_costs.py: what a round trip costs this host after an idle gap, and a claim.

::

    .venv/bin/python benchmarks/idle_costs.py [--database-url URL] [--rounds N] [--gap S]

The ``latency`` workload of ``run.py`` enqueues a task every 20 ms to an idle worker, so every
hop of its path (the notification, the claim, the claim's commit) starts on processes that
have been asleep. On a virtual machine a sleeping vCPU halts, and waking it costs far more
than the work. This script separates the two: in a throwaway database (``--database-url``,
else the server ``benchmarks/_server.py`` finds) it times, over one held autocommit
connection, each statement back to back ("hot") and after ``--gap`` seconds of sleep ("after
idle", default 0.020 like ``latency``):

* ``SELECT 1``: the round trip alone;
* ``INSERT + COMMIT`` of one row into a one-column table: a commit's WAL flush;
* a bare claim, ``UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1)
  RETURNING`` on a minimal queue table: what a queue without attempt rows, fencing or
  capacity pays to claim one task;
* the library's ``CLAIM`` of one task (enqueued just before, outside the clock) in the shipped
  schema.

It prints each one's median and 90th percentile in milliseconds.

Then it times the bare claim after a notification, as an idle worker claims: a producer process
inserts a row and notifies every ``--gap`` seconds; the consumer waits on its ``LISTEN``
connection and claims the row, alternately on that connection (whose backend has just woken
to deliver the notification) and on a second one (as the worker does, whose backend slept).
Each figure runs from the producer's ``INSERT`` to the claim's rows, on the monotonic clock
both processes share.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from _server import libpq_url, scratch_database
from sqlalchemy import create_engine

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._driver_sql import driver_statement
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements.claim import Capability, capability_params

_BARE_TABLE = (
    "CREATE TABLE bare_queue (id bigserial PRIMARY KEY, state text NOT NULL DEFAULT 'pending',"
    " payload jsonb)"
)
_BARE_INDEX = "CREATE INDEX ON bare_queue (id) WHERE state = 'pending'"
_BARE_CLAIM = (
    "UPDATE bare_queue SET state = 'running' WHERE id = (SELECT id FROM bare_queue"
    " WHERE state = 'pending' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, payload"
)


def timed(
    conn: psycopg.Connection[Any], rounds: int, gap: float, before: Callable[[], None],
    sql: str, params: Any = None,
) -> list[float]:
    """Milliseconds of ``sql`` per round; ``before`` runs first in each round, off the clock,
    and then the round sleeps ``gap`` seconds (none: back to back)."""
    millis = []
    for _ in range(rounds):
        before()
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        cursor = conn.execute(sql, params)
        if cursor.description is not None:
            cursor.fetchall()
        millis.append((time.perf_counter() - start) * 1000)
    return millis


def _produce(conninfo: str, rounds: int, gap: float) -> None:
    with psycopg.connect(conninfo, autocommit=True) as producer:
        for _ in range(rounds):
            time.sleep(gap)
            with producer.transaction():
                start = time.monotonic()
                producer.execute("INSERT INTO bare_queue (payload) VALUES ('{}')")
                producer.execute("SELECT pg_notify('idle_costs', %s)", (repr(start),))


def notified_claims(conninfo: str, rounds: int, gap: float) -> dict[str, list[float]]:
    """Milliseconds from a producer's insert to the bare claim's rows, by the connection that
    claims (the ``LISTEN`` one, or another), ``rounds`` claims each."""
    millis: dict[str, list[float]] = {"listening": [], "other": []}
    with psycopg.connect(conninfo, autocommit=True) as listener, psycopg.connect(
        conninfo, autocommit=True
    ) as other:
        listener.execute("LISTEN idle_costs")
        # spawn: a forked child would close these connections' sockets as it exits.
        producer = multiprocessing.get_context("spawn").Process(
            target=_produce, args=(conninfo, 2 * rounds, gap)
        )
        producer.start()
        try:
            for index in range(2 * rounds):
                # notifies() holds the connection until it returns: one notification at a time.
                payloads = [
                    note.payload for note in listener.notifies(timeout=30, stop_after=1)
                ]
                if not payloads:
                    raise SystemExit(
                        f"no notification in 30 s (producer exit code {producer.exitcode})"
                    )
                claimer, label = (listener, "listening") if index % 2 == 0 else (other, "other")
                claimer.execute(_BARE_CLAIM).fetchall()
                millis[label].append((time.monotonic() - float(payloads[0])) * 1000)
        finally:
            producer.join()
    return millis


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", metavar="URL")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.020)
    args = parser.parse_args(argv)
    with scratch_database(args.database_url, "pgtask_idle") as url, psycopg.connect(
        libpq_url(url), autocommit=True
    ) as conn, psycopg.connect(libpq_url(url), autocommit=True) as producer:
        conn.execute("CREATE TABLE one_row (v int)")
        conn.execute(_BARE_TABLE)
        conn.execute(_BARE_INDEX)
        capabilities = capability_params(
            ["default"], [Capability("default", "noop", 1, RetryPolicy("never"), 3)]
        )
        engine = create_engine(url)
        with engine.connect() as probe:
            claim = driver_statement(probe, statements.CLAIM)
        engine.dispose()
        assert claim is not None
        params = claim.parameters(statements.claim_params(
            capabilities, worker_id=uuid.uuid4(), lease_seconds=30.0, limit=10,
        ))

        def enqueue_one() -> None:
            producer.execute(
                "INSERT INTO pgtask.tasks (id, queue, name, payload) VALUES (%s, 'default',"
                " 'noop', '{}')", (uuid.uuid4(),),
            )

        def bare_one() -> None:
            producer.execute("INSERT INTO bare_queue (payload) VALUES ('{}')")

        def nothing() -> None:
            return None

        cases: list[tuple[str, Callable[[], None], str, Any]] = [
            ("SELECT 1", nothing, "SELECT 1", None),
            ("INSERT + COMMIT", nothing, "INSERT INTO one_row VALUES (1)", None),
            ("bare claim of one task", bare_one, _BARE_CLAIM, None),
            ("library CLAIM of one task", enqueue_one, claim.sql, params),
        ]
        print(f"{args.rounds} rounds each; milliseconds; idle gap {args.gap * 1000:.0f} ms\n")
        print(f"{'statement':28} {'hot p50':>8} {'p90':>7} {'after idle p50':>15} {'p90':>7}")
        for label, before, sql, values in cases:
            timed(conn, 20, 0.0, before, sql, values)  # warm plans and caches
            hot = timed(conn, args.rounds, 0.0, before, sql, values)
            idle = timed(conn, args.rounds, args.gap, before, sql, values)
            print(f"{label:28} {statistics.median(hot):8.3f} {_p90(hot):7.3f}"
                  f" {statistics.median(idle):15.3f} {_p90(idle):7.3f}")
        print(f"\ninsert + notify -> bare claim, {args.rounds} rounds each, gap"
              f" {args.gap * 1000:.0f} ms")
        print(f"{'claimed on':28} {'p50':>8} {'p90':>7}")
        for label, values in notified_claims(libpq_url(url), args.rounds, args.gap).items():
            print(f"{label + ' connection':28} {statistics.median(values):8.3f}"
                  f" {_p90(values):7.3f}")
    return 0


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[8]


if __name__ == "__main__":
    sys.exit(main())
