"""benchmarks/enqueue_paths.py: a single enqueue's cost by path, interleaved so a noisy host
shakes every path alike (run on demand; not a test; prints figures).

::

    .venv/bin/python benchmarks/enqueue_paths.py [--database-url URL] [--rounds R] [--block B]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds) and installs the schema. Each
of ``R`` rounds (default 15) runs a block of ``B`` (default 200) BEGIN/INSERT/COMMIT loops per
path, in an order that alternates from round to round, on one held connection each:

* ``raw``: psycopg's ``execute`` of a four-parameter INSERT, then ``commit`` (the
  ``baseline_insert`` of ``run.py``);
* ``plain``: ``enqueue(connection, "noop", {...})`` with every option default, then
  ``connection.commit()``: `statements.ENQUEUE_PLAIN`, sent as text compiled once;
* ``option``: the same with ``priority=1``: `statements.ENQUEUE_ONE` (eleven parameters),
  sent as text compiled once;
* ``plain compiled`` and ``option compiled``: the same two on a connection with a
  ``schema_translate_map`` that maps nothing, which makes every execution go through
  SQLAlchemy's compiled path, as every enqueue did before 2026-12-02.

It prints, per path, the median over rounds of client CPU and wall time per task, and each
path's throughput relative to ``raw`` (per round, then the median), the figure the
performance issue judges (``>= 0.9``). The database is dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable

import psycopg
from _server import libpq_url, scratch_database
from sqlalchemy import create_engine

from sqlalchemy_pgtask import enqueue

RAW_INSERT = """
INSERT INTO pgtask.tasks
    (id, queue, name, version, payload, headers, priority, max_attempts, run_at)
VALUES (%s, %s, %s, 1, %s::jsonb, '{}'::jsonb, 0, 5, statement_timestamp())
"""

#: Maps nothing, but any map sends an enqueue down SQLAlchemy's compiled path.
COMPILED = {"schema_translate_map": {None: None}}


#: Per path, one (client CPU, wall) pair in microseconds per task for each round.
Figures = dict[str, list[tuple[float, float]]]


def measure(url: str, conninfo: str, rounds: int, block: int) -> Figures:
    engine = create_engine(url)
    try:
        with (
            psycopg.connect(conninfo) as raw,
            engine.connect() as fast,
            engine.connect() as held,
        ):
            compiled = held.execution_options(**COMPILED)

            def raw_loop(i: int) -> None:
                raw.execute(RAW_INSERT, (uuid.uuid4(), "default", "noop", json.dumps({"i": i})))
                raw.commit()

            def plain(i: int) -> None:
                enqueue(fast, "noop", {"i": i})
                fast.commit()

            def option(i: int) -> None:
                enqueue(fast, "noop", {"i": i}, priority=1)
                fast.commit()

            def plain_compiled(i: int) -> None:
                enqueue(compiled, "noop", {"i": i})
                compiled.commit()

            def option_compiled(i: int) -> None:
                enqueue(compiled, "noop", {"i": i}, priority=1)
                compiled.commit()

            paths: dict[str, Callable[[int], None]] = {
                "raw": raw_loop, "plain": plain, "option": option,
                "plain compiled": plain_compiled, "option compiled": option_compiled,
            }
            figures: Figures = {name: [] for name in paths}
            for one in paths.values():  # warm up: prepared statements, compiled caches
                for i in range(20):
                    one(i)
            names = list(paths)
            for r in range(rounds):
                for name in names if r % 2 == 0 else reversed(names):
                    one = paths[name]
                    cpu, wall = time.process_time(), time.perf_counter()
                    for i in range(block):
                        one(i)
                    figures[name].append((
                        (time.process_time() - cpu) / block * 1e6,
                        (time.perf_counter() - wall) / block * 1e6,
                    ))
            return figures
    finally:
        engine.dispose()


def report(figures: Figures) -> None:
    raw = figures["raw"]
    print(f"{'path':<16} {'client CPU/task':>16} {'wall/task':>10} {'vs raw':>7}")
    for name, runs in figures.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        ratio = statistics.median(r[1] / w[1] for r, w in zip(raw, runs, strict=True))
        print(f"{name:<16} {cpu:>13.0f} us {wall:>7.0f} us {ratio:>7.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=200)
    args = parser.parse_args()
    with scratch_database(args.database_url, "pgtask_bench_enqueue") as url:
        report(measure(url, libpq_url(url), args.rounds, args.block))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
