"""benchmarks/dashboard_timeline.py: the dashboard's task page of a long workflow (run on
demand; not a test; prints figures).

::

    .venv/bin/python benchmarks/dashboard_timeline.py [--database-url URL] [--steps N]
        [--attempts A] [--children C] [--runs R]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds), installs the schema and writes one workflow task with
``--steps`` checkpoints (default 100,000; every 10th a sleep), ``--attempts`` attempts
(default 2,000, all suspended but the last, which failed) and ``--children`` children
(default 1,000), with plain ``INSERT ... SELECT generate_series``. It then times, ``R`` times
each (default 20): `status.task_detail` unbounded (everything, as the page read it before the
timeline) and bounded as the page reads it (the newest `TIMELINE_LIMIT` of each), the
timeline's own reads, and the whole page through the app (Starlette's test client: routing,
the reads, `explain`, the templates). The database is dropped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from _server import scratch_database
from dashboard import read_only, timed
from sqlalchemy import Connection, Engine, create_engine, text
from starlette.testclient import TestClient

from sqlalchemy_pgtask import enqueue, status
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._timeline import TIMELINE_LIMIT, timeline

STEPS_SQL = """
INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value, created_at)
SELECT :task, 1, 'step-' || (i % 50), i,
       CASE WHEN i % 10 = 0 THEN 'sleep' ELSE 'step' END,
       CASE WHEN i % 10 = 0
            THEN jsonb_build_object('wake_at', statement_timestamp()
                 - make_interval(secs => (CAST(:n AS int) - i) * 3.0) + interval '1 second')
            ELSE jsonb_build_object('i', i) END,
       statement_timestamp() - make_interval(secs => (CAST(:n AS int) - i) * 3.0)
FROM generate_series(0, CAST(:n AS int) - 1) AS i
"""
ATTEMPTS_SQL = """
INSERT INTO pgtask.attempts (task_id, attempt, lease_token, state, started_at, finished_at,
                             error)
SELECT :task, i, gen_random_uuid(),
       CASE WHEN i = CAST(:n AS int) THEN 'failed' ELSE 'suspended' END,
       statement_timestamp() - make_interval(secs => (CAST(:n AS int) - i) * 150.0 + 2),
       statement_timestamp() - make_interval(secs => (CAST(:n AS int) - i) * 150.0 + 1),
       CASE WHEN i = CAST(:n AS int)
            THEN jsonb_build_object('type', 'handler_error', 'exception', 'ValueError',
                                    'message', 'no seat left') END
FROM generate_series(1, CAST(:n AS int)) AS i
"""


def fill(engine: Engine, steps: int, attempts: int, children: int) -> uuid.UUID:
    with engine.begin() as connection:
        task = enqueue(connection, "long.workflow", {"trip": 1}).id
        kids = [enqueue(connection, "long.child", {"n": n}).id for n in range(children)]
        connection.execute(
            text("UPDATE pgtask.tasks SET parent_id = :task WHERE id = ANY(:kids)"),
            {"task": task, "kids": kids},
        )
        connection.execute(text(STEPS_SQL), {"task": task, "n": steps})
        connection.execute(text(ATTEMPTS_SQL), {"task": task, "n": attempts})
        connection.execute(
            text("UPDATE pgtask.tasks SET attempt = :n, max_attempts = 1, failed_attempts = 1,"
                 " has_children = :kids WHERE id = :task"),
            {"task": task, "n": attempts, "kids": children > 0},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        for table in ("tasks", "checkpoints", "attempts"):
            connection.execute(text(f"VACUUM ANALYZE pgtask.{table}"))
    return task


def bounded(connection: Connection, task: uuid.UUID) -> status.TaskDetail | None:
    return status.task_detail(
        connection, task, attempts_limit=TIMELINE_LIMIT, steps_limit=TIMELINE_LIMIT,
        children_limit=TIMELINE_LIMIT,
    )


def measure(engine: Engine, task: uuid.UUID, runs: int) -> None:
    def drawn(connection: Connection) -> Any:
        detail = bounded(connection, task)
        assert detail is not None
        now = connection.scalar(text("SELECT pgtask.now()"))
        return timeline(connection, detail, now)

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("task_detail, unbounded", lambda: read_only(
            engine, lambda c: status.task_detail(c, task))),
        (f"task_detail, newest {TIMELINE_LIMIT}", lambda: read_only(
            engine, lambda c: bounded(c, task))),
        ("task_detail + timeline reads", lambda: read_only(engine, drawn)),
    ]
    with TestClient(create_app(engine)) as client:
        def page() -> None:
            answer = client.get(f"/tasks/{task}")
            assert answer.status_code == 200, answer.text[:200]

        cases.append(("the whole task page", page))
        print(f"{'read':36} {'median ms':>10} {'p95 ms':>8}")
        for label, action in cases:
            median, p95 = timed(action, runs)
            print(f"{label:36} {median:10.1f} {p95:8.1f}")
        size = len(client.get(f"/tasks/{task}").content)
        print(f"page size: {size / 1024:.0f} KiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--attempts", type=int, default=2_000)
    parser.add_argument("--children", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database(args.database_url, "pgtask_bench_timeline"))
        engine = create_engine(url)
        stack.callback(engine.dispose)
        started = time.perf_counter()
        task = fill(engine, args.steps, args.attempts, args.children)
        print(f"wrote one workflow: {args.steps:,} steps, {args.attempts:,} attempts, "
              f"{args.children:,} children in {time.perf_counter() - started:.1f} s")
        measure(engine, task, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
