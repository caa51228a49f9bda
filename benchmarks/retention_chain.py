"""benchmarks/retention_chain.py: retention of deep expired workflow chains.

One command (run on demand; it is not a test)::

    .venv/bin/python benchmarks/retention_chain.py [--database-url URL] [--depth N ...]
                                                   [--batch-size B]

For each depth (default 2,000 and 10,000) it creates a throwaway database (``--database-url``,
else the server that ``benchmarks/_server.py`` finds), installs the schema, inserts one chain of
that many finished tasks (each the parent of the next, finished 30 days ago) and 1,000 lone
finished tasks beside it, analyses, and times one `run_retention` (batches of ``B``, default
1,000). Reported per depth: tasks deleted, each task batch (DELETE statement) with its rows
and its time as the client saw it, and the whole run's wall time (every kind of batch).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _server import scratch_database
from sqlalchemy import create_engine, event, text

from sqlalchemy_pgtask.retention import run_retention

_CHAIN = text(
    "WITH RECURSIVE ids(n, id, parent_id) AS ("
    "  SELECT 1, gen_random_uuid(), NULL::uuid"
    "  UNION ALL SELECT n + 1, gen_random_uuid(), id FROM ids WHERE n < :depth)"
    " INSERT INTO pgtask.tasks (id, queue, name, payload, state, attempt, max_attempts,"
    "  completed_at, parent_id, has_children)"
    " SELECT id, 'default', 'job', 'null', 'succeeded', 1, 1,"
    "  pgtask.now() - interval '30 days', parent_id, n < :depth FROM ids"
)
_LONE = text(
    "INSERT INTO pgtask.tasks (queue, name, payload, state, attempt, max_attempts, completed_at)"
    " SELECT 'default', 'job', 'null', 'succeeded', 1, 1,"
    "  pgtask.now() - interval '30 days' - make_interval(secs => i) FROM generate_series(1, 1000) i"
)


def measure(database_url: str | None, depth: int, batch_size: int) -> str:
    with scratch_database(database_url, f"pgtask_bench_chain_{depth}") as url:
        engine = create_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(_CHAIN, {"depth": depth})
                conn.execute(_LONE)
            with engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                    text("ANALYZE pgtask.tasks"))
            deletes: list[tuple[int, float]] = []
            started: dict[str, float] = {}

            def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                started["at"] = time.perf_counter()

            def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                if "DELETE FROM pgtask.tasks WHERE" in statement:
                    deletes.append((cursor.rowcount, time.perf_counter() - started["at"]))

            event.listen(engine, "before_cursor_execute", before)
            event.listen(engine, "after_cursor_execute", after)
            begun = time.perf_counter()
            result = run_retention(engine, batch_size=batch_size)
            wall = time.perf_counter() - begun
        finally:
            engine.dispose()
    batches = ", ".join(f"{rows:,} rows in {seconds:.2f} s" for rows, seconds in deletes)
    return (
        f"chain of {depth:,} + 1,000 lone tasks: {result.tasks_deleted:,} deleted in"
        f" {len(deletes)} task batch(es) ({batches}); the whole run {wall:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--depth", type=int, nargs="+", default=[2_000, 10_000])
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    for depth in args.depth:
        print(measure(args.database_url, depth, args.batch_size), flush=True)


if __name__ == "__main__":
    main()
