"""benchmarks/dashboard_bulk.py: what the first step of a dashboard bulk action (the count of
the filtered selection) costs on a large table (run on demand; not a test; prints figures).

::

    .venv/bin/python benchmarks/dashboard_bulk.py [--database-url URL] [--tasks N] [--runs R]

The table is `benchmarks/dashboard.py`'s (``--tasks`` tasks, default 1,000,000: 10 queues, 20
names, 30 days, 86 % succeeded, 5 % failed, 2 % cancelled, 7 % pending). Each case posts the
task list's filters to ``/tasks/bulk/{action}`` through the app (CSRF, the count in a
read-only snapshot, the confirmation page) ``R`` times and prints the median and p95 with the
count's plan; nothing is written. A selection over 1,000 tasks is refused after reading 1,001.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from _server import scratch_database
from dashboard import fill, timed
from sqlalchemy import Engine, create_engine, select, text
from starlette.datastructures import FormData
from starlette.testclient import TestClient

from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._bulk import BULK_MAX, _conditions, _filters
from sqlalchemy_pgtask.models import Task

TOKEN = "benchmark-admin-token"
#: (label, action, the task list's filters)
CASES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("retry: failed in one queue, last hour", "retry",
     {"state": "failed", "queue": "q3", "since": "LAST_HOUR"}),
    ("retry: failed in one queue (refused)", "retry", {"state": "failed", "queue": "q3"}),
    ("retry: everything (refused)", "retry", {}),
    ("cancel: one queue", "cancel", {"queue": "q3"}),
    ("cancel: one name, last day", "cancel", {"name": "task-7", "since": "LAST_DAY"}),
    ("retry: one idempotency key", "retry", {"q": "key-500", "queue": "q5"}),
)


def _plan(engine: Engine, action: str, fields: dict[str, str]) -> str:
    filters, _ = _filters(FormData(list(fields.items())))
    query = select(Task.id).where(*_conditions(filters, action, None)).limit(BULK_MAX + 1)
    compiled = str(query.compile(bind=engine, compile_kwargs={"literal_binds": True}))
    with engine.connect() as connection:
        lines = connection.execute(text("EXPLAIN " + compiled)).scalars().all()
    return "; ".join(line.strip() for line in lines if "Scan" in line)[:140]


def _resolve(engine: Engine, fields: dict[str, str]) -> dict[str, str]:
    with engine.connect() as connection:
        now = connection.execute(text("SELECT now()")).scalar_one()
    stamps = {"LAST_HOUR": now.replace(microsecond=0) - timedelta(hours=1),
              "LAST_DAY": now.replace(microsecond=0) - timedelta(days=1)}
    return {k: stamps[v].isoformat() if v in stamps else v for k, v in fields.items()}


def measure(engine: Engine, runs: int) -> None:
    with TestClient(create_app(engine, admin_token=TOKEN), follow_redirects=False) as client:
        client.get("/login")
        client.post("/login", data={"csrf_token": client.cookies["pgtask_csrf"],
                                    "token": TOKEN, "name": "bench"})
        csrf = client.cookies["pgtask_csrf"]
        print(f"{'bulk count':40} {'page ms (median / p95)':>24}  status  plan")
        for label, action, raw in CASES:
            fields = _resolve(engine, raw)

            def post(a: str = action, f: dict[str, str] = fields) -> Any:
                return client.post(f"/tasks/bulk/{a}", data={"csrf_token": csrf, **f})

            med, p95 = timed(post, runs)
            status = post().status_code
            print(f"{label:40} {med:11.1f} / {p95:8.1f}   {status:>5}  "
                  f"{_plan(engine, action, fields)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for option, kind, default in (("--database-url", str, None),
                                  ("--tasks", int, 1_000_000), ("--runs", int, 20)):
        parser.add_argument(option, type=kind, default=default)
    args = parser.parse_args()
    with scratch_database(args.database_url, "pgtask_bench_bulk") as url:
        engine = create_engine(url)
        try:
            print(f"inserted {args.tasks:,} tasks in {fill(engine, args.tasks):.1f} s")
            measure(engine, args.runs)
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
