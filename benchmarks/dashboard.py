"""benchmarks/dashboard.py: the dashboard's pages on a large table (run on demand; not a
test; prints figures).

::

    .venv/bin/python benchmarks/dashboard.py [--database-url URL] [--tasks N] [--runs R]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds), installs the schema, inserts
``--tasks`` tasks (default 1,000,000) with ``INSERT ... SELECT generate_series``: 10 queues,
20 names, created over 30 days with time-ordered ids like the library's (UUID version 7);
86 % succeeded, 5 % failed, 2 % cancelled, 7 % pending; every 10th with an idempotency key
and its reservation row. It analyses, then times filtered pages of the task list ``R`` times
each (default 20): the query alone (`task_page` in the read-only snapshot the app uses) and
the whole page through the app (Starlette's test client: routing, the query, the template),
and prints the plan's scans and how many tasks each page read (`TaskPage.searched_to` is set
when a page stopped at `SCAN_LIMIT`). Then the other pages ``R`` times each through the app:
the overview with its charts of the last hour and of the last day, the live fragments of the
overview, the task list and a task's page (``X-Pgtask-Fragment: live``), searches by payload
(JSON containment, bounded by `SCAN_LIMIT`) and a task's page; and the chart statement and
the payload search's plan (the chart statement both reading the whole window and with the
closed buckets cached, as the app reads it). The database is dropped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from _server import scratch_database
from sqlalchemy import Connection, Engine, create_engine, event, text
from starlette.testclient import TestClient

from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._chart_cache import ChartCache
from sqlalchemy_pgtask.dashboard._charts import WINDOWS, queue_charts
from sqlalchemy_pgtask.dashboard._payload import parse_payload_filter
from sqlalchemy_pgtask.dashboard._task_list import SCAN_LIMIT, TaskFilters, TaskPage, task_page

FILL_SQL = """
WITH made AS (
    INSERT INTO pgtask.tasks (id, queue, name, payload, state, attempt, failed_attempts,
                              max_attempts, created_at, updated_at, completed_at,
                              idempotency_key, run_at)
    SELECT CAST(lpad(to_hex(CAST(extract(epoch FROM c.at) * 1000 AS bigint)), 12, '0')
                || '7' || substr(md5(random()::text), 1, 3) || '8'
                || substr(md5(random()::text), 1, 15) AS uuid),
           'q' || (i / 100 % 10), 'task-' || (i / 7 % 20), jsonb_build_object('i', i), s.state,
           CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END,
           CASE WHEN s.state = 'failed' THEN 1 ELSE 0 END,
           CASE WHEN s.state = 'pending' THEN NULL ELSE 1 END,
           c.at, c.at,
           CASE WHEN s.state = 'pending' THEN NULL ELSE c.at + interval '1 second' END,
           CASE WHEN i % 10 = 0 THEN 'key-' || i END,
           c.at
    FROM generate_series(CAST(:start AS int), CAST(:stop AS int)) AS i
    CROSS JOIN LATERAL (SELECT CASE
        WHEN i % 100 < 86 THEN 'succeeded' WHEN i % 100 < 91 THEN 'failed'
        WHEN i % 100 < 93 THEN 'cancelled' ELSE 'pending' END AS state) AS s
    CROSS JOIN LATERAL (SELECT statement_timestamp()
        - make_interval(secs => (CAST(:total AS int) - i) * 2592000.0
                                / CAST(:total AS int)) AS at) AS c
    RETURNING id, queue, idempotency_key, created_at
)
INSERT INTO pgtask.idempotency_keys (queue, key, task_id, created_at)
SELECT queue, idempotency_key, id, created_at FROM made WHERE idempotency_key IS NOT NULL
"""

def fill(engine: Engine, total: int) -> float:
    started = time.perf_counter()
    step = 100_000
    for start in range(1, total + 1, step):
        with engine.begin() as connection:
            connection.execute(
                text(FILL_SQL),
                {"start": start, "stop": min(start + step - 1, total), "total": total},
            )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text("VACUUM ANALYZE pgtask.tasks"))
        connection.execute(text("VACUUM ANALYZE pgtask.idempotency_keys"))
    return time.perf_counter() - started


def read_only(engine: Engine, action: Callable[[Connection], Any]) -> Any:
    with engine.connect() as connection:
        connection.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        try:
            return action(connection)
        finally:
            connection.rollback()


def cases(engine: Engine) -> list[tuple[str, TaskFilters, str, str | None]]:
    """(label, filters, query string, cursor) of each timed page."""
    def probe(connection: Connection) -> tuple[uuid.UUID, str, str | None]:
        some = connection.execute(text(
            "SELECT id FROM pgtask.tasks WHERE created_at < now() - interval '15 days' LIMIT 1"
        )).scalar_one()
        key = connection.execute(text(
            "SELECT key FROM pgtask.idempotency_keys WHERE queue = 'q0' LIMIT 1"
        )).scalar_one()
        first = task_page(connection, TaskFilters(), limit=50)
        return some, key, first.next_cursor

    some, key, cursor = read_only(engine, probe)
    now = datetime.now(timezone.utc)
    day = (now - timedelta(days=10), now - timedelta(days=9))
    return [
        ("no filter, first page", TaskFilters(), "", None),
        ("no filter, second page", TaskFilters(), "", cursor),
        ("state=failed", TaskFilters(state="failed"), "state=failed", None),
        ("state=pending", TaskFilters(state="pending"), "state=pending", None),
        ("queue=q3", TaskFilters(queue="q3"), "queue=q3", None),
        ("queue=q3 state=failed", TaskFilters(queue="q3", state="failed"),
         "queue=q3&state=failed", None),
        ("name=task-7", TaskFilters(name="task-7"), "name=task-7", None),
        ("queue=q3 name=nothing", TaskFilters(queue="q3", name="nothing"),
         "queue=q3&name=nothing", None),
        ("name=nothing", TaskFilters(name="nothing"), "name=nothing", None),
        ("queue=q3 state=cancelled name=task-5",
         TaskFilters(queue="q3", state="cancelled", name="task-5"),
         "queue=q3&state=cancelled&name=task-5", None),
        ("state=failed, 10 days ago", TaskFilters(state="failed", since=day[0], until=day[1]),
         f"state=failed&since={day[0].isoformat()}&until={day[1].isoformat()}".replace("+", "%2B"),
         None),
        ("one day, 10 days ago", TaskFilters(since=day[0], until=day[1]),
         f"since={day[0].isoformat()}&until={day[1].isoformat()}".replace("+", "%2B"), None),
        ("search: task id", TaskFilters(search=str(some)), f"q={some}", None),
        ("search: key + queue", TaskFilters(search=key, queue="q0"), f"q={key}&queue=q0", None),
        ("search: key alone", TaskFilters(search=key), f"q={key}", None),
    ]


def timed(action: Callable[[], Any], runs: int) -> tuple[float, float]:
    action()  # warm the cache and the connection pool
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[max(0, int(len(samples) * 0.95) - 1)]


def plan(engine: Engine, filters: TaskFilters, cursor: str | None) -> str:
    """The first line of the query's plan that names a scan."""
    def explain(connection: Connection) -> str:
        captured: list[Any] = []

        def capture(conn: Any, cursor_: Any, statement: str, params: Any, *_: Any) -> None:
            captured.append((statement, params))

        event.listen(connection, "before_cursor_execute", capture)
        task_page(connection, filters, limit=50, after=cursor)
        event.remove(connection, "before_cursor_execute", capture)
        statement, params = captured[-1]  # the page's read (a filtered one finds its floor first)
        rows = connection.exec_driver_sql("EXPLAIN " + statement, params).scalars().all()
        scans = [r.strip().lstrip("-> ") for r in rows if "Scan" in r]
        return "; ".join(s.split("  (")[0] for s in scans[:2])

    return str(read_only(engine, explain))


def measure(engine: Engine, runs: int) -> None:
    client = TestClient(create_app(engine))
    client.__enter__()  # one event loop for every request, as a server has
    print(f"{'page':38} {'query ms (median / p95)':>24} {'page ms (median / p95)':>24}"
          "  found  plan")
    for label, filters, query, cursor in cases(engine):
        def one(f: TaskFilters = filters, c: str | None = cursor) -> TaskPage:
            return cast(TaskPage, read_only(
                engine, lambda conn: task_page(conn, f, limit=50, after=c)
            ))

        q_med, q_p95 = timed(one, runs)
        page = one()
        found = f"{len(page.tasks)}{'*' if page.searched_to is not None else ''}"
        url = "/tasks?" + query + (f"&after={cursor}".replace("+", "%2B") if cursor else "")
        def view(u: str = url) -> Any:
            return client.get(u).raise_for_status()

        p_med, p_p95 = timed(view, runs)
        print(f"{label:38} {q_med:11.1f} / {q_p95:8.1f}   {p_med:11.1f} / {p_p95:8.1f}  "
              f"{found:>5}  {plan(engine, filters, cursor)}", flush=True)
    client.__exit__(None, None, None)
    print(f"* the page stopped after reading {SCAN_LIMIT:,} tasks (TaskPage.searched_to)")


def pages(engine: Engine, runs: int) -> None:
    """The overview, charts, live fragments and payload searches: p95 per page."""
    task_id = read_only(engine, lambda c: c.execute(text(
        "SELECT id FROM pgtask.tasks WHERE created_at < now() - interval '15 days' LIMIT 1"
    )).scalar_one())
    live = {"X-Pgtask-Fragment": "live"}
    rows = [
        ("overview (charts: last hour)", "/", {}),
        ("overview (charts: last day)", "/?chart=day", {}),
        ("overview, live fragment", "/", live),
        ("task list, live fragment", "/tasks", live),
        ("task list state=failed, live", "/tasks?state=failed", live),
        ("payload {\"i\": 5} (oldest)", '/tasks?payload={"i": 5}', {}),
        ("payload {\"i\": 999990} (newest)", '/tasks?payload={"i": 999990}', {}),
        ("payload + queue=q3", '/tasks?payload={"i": 5}&queue=q3', {}),
        ("payload, 1 day 10 days ago", "/tasks?payload=%7B%22i%22%3A%205%7D&since="
         + (datetime.now(timezone.utc) - timedelta(days=10)).strftime("%Y-%m-%dT%H:%M:%S")
         + "&until="
         + (datetime.now(timezone.utc) - timedelta(days=9)).strftime("%Y-%m-%dT%H:%M:%S"), {}),
        ("task page", f"/tasks/{task_id}", {}),
        ("task page, live fragment", f"/tasks/{task_id}", live),
    ]
    client = TestClient(create_app(engine))
    client.__enter__()
    print(f"\n{'page':38} {'page ms (median / p95)':>24}")
    for label, url, headers in rows:
        def view(u: str = url, h: dict[str, str] = headers) -> Any:
            return client.get(u, headers=h).raise_for_status()

        median, p95 = timed(view, runs)
        print(f"{label:38} {median:11.1f} / {p95:8.1f}", flush=True)
    client.__exit__(None, None, None)
    for window in WINDOWS.values():
        def chart(w: Any = window) -> Any:
            return read_only(engine, lambda c: queue_charts(c, w, {}))

        median, p95 = timed(chart, runs)
        print(f"chart statement, {window.label:21} {median:11.1f} / {p95:8.1f}  (query ms)")
        cache = ChartCache()

        def cached(w: Any = window, k: ChartCache = cache) -> Any:
            return read_only(engine, lambda c: queue_charts(c, w, {}, k))

        median, p95 = timed(cached, runs)  # the warm-up fills the cache
        print(f"  with the closed buckets cached {median:11.1f} / {p95:8.1f}  (query ms)")
    print("payload plan:", plan(engine, TaskFilters(
        payload=parse_payload_filter('{"i": 5}')), None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database(args.database_url, "pgtask_bench_dashboard"))
        engine = create_engine(url)
        stack.callback(engine.dispose)
        seconds = fill(engine, args.tasks)
        print(f"inserted {args.tasks:,} tasks in {seconds:.1f} s")
        measure(engine, args.runs)
        pages(engine, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
