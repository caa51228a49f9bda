"""benchmarks/explain_hot.py: EXPLAIN (ANALYZE, BUFFERS) of the worker's hot statements.

::

    .venv/bin/python benchmarks/explain_hot.py [--database-url URL] [--tasks N] [--batch B]

Creates a throwaway database, installs the schema, enqueues ``N`` tasks (``ANALYZE`` then, as
`run.py` does before a drain), drains half of them with the library's own CLAIM and COMPLETE
(so the tables hold dead row versions and attempt rows as in the middle of a drain), claims one
more batch of ``B``, and then shows each hot statement of ``sqlalchemy_pgtask.statements``
twice, inside a rolled-back transaction:

* ``custom``: planned for the actual parameter values (what ``plan_cache_mode = auto`` does
  while it keeps choosing custom plans);
* ``generic``: ``PREPARE`` + ``SET plan_cache_mode = force_generic_plan`` + ``EXPLAIN EXECUTE``,
  the plan a prepared statement gets once PostgreSQL switches to a generic plan.

Also prints, per statement, the planning time of a custom plan (median of 20 ``EXPLAIN``
without ANALYZE, as reported by ``SUMMARY``), which a statement pays on every execution for as
long as it is custom-planned.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import make_url
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import ClauseElement

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import psycopg_url, server

from sqlalchemy_pgtask import EnqueueRequest, enqueue_many, statements
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.registry import DEFAULT_RETRY
from sqlalchemy_pgtask.testing import (
    create_database,
    drop_database,
)

_DIALECT = postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]
_PARAM = re.compile(r"%\((\w+)\)s")


def compile_positional(statement: ClauseElement) -> tuple[str, list[str], dict[str, Any]]:
    """The statement's SQL with ``$n`` placeholders, the parameter names, and bound defaults."""
    compiled = statement.compile(dialect=_DIALECT)
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    text = _PARAM.sub(number, compiled.string).replace("%%", "%")
    return text, names, dict(compiled.params)


CAPABILITIES = statements.capability_params(
    ["default"], [statements.Capability("default", "noop", 1, DEFAULT_RETRY, 5)]
)


def claim_params(limit: int, worker: uuid.UUID) -> dict[str, Any]:
    return dict(
        statements.claim_params(CAPABILITIES, worker_id=worker, lease_seconds=30.0, limit=limit)
    )


def leases(rows: Any) -> list[statements.Lease]:
    return [statements.Lease(r[0], r[7], r[10]) for r in rows]


def execute(conn: psycopg.Connection[Any], statement: ClauseElement, params: dict[str, Any]
            ) -> list[Any]:
    """Run a library statement with psycopg (rows as tuples, in the statement's column order)."""
    compiled = statement.compile(dialect=_DIALECT)
    return conn.execute(compiled.string, {**compiled.params, **params}).fetchall()


def _lines(conn: psycopg.Connection[Any], query: sql.Composed) -> list[str]:
    return [line for (line,) in conn.execute(query).fetchall()]


def explain(conn: psycopg.Connection[Any], label: str, statement: ClauseElement,
            params: dict[str, Any], *, runs: int = 3) -> None:
    """Print the custom and the generic plan of ``statement``, each from its last of ``runs``
    executions (the first in a session also builds trigger and foreign-key plans)."""
    text, names, defaults = compile_positional(statement)
    values = {**defaults, **params}
    args = sql.SQL(", ").join(sql.Literal(values[n]) for n in names)
    analyze = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, SUMMARY) EXECUTE hot({})").format(args)
    for mode in ("custom", "generic"):
        conn.execute(f"SET plan_cache_mode = force_{mode}_plan")
        conn.execute(f"PREPARE hot AS {text}")
        try:
            plan_ms = []
            if mode == "custom":
                for _ in range(20):
                    plan = _lines(conn, sql.SQL("EXPLAIN (SUMMARY) EXECUTE hot({})").format(args))
                    plan_ms += [float(x.split()[2]) for x in plan if x.startswith("Planning Time")]
            for _ in range(runs):
                conn.execute("BEGIN")
                try:
                    plan = _lines(conn, analyze)
                finally:
                    conn.execute("ROLLBACK")
        finally:
            conn.execute("DEALLOCATE hot")  # PREPARE is not undone by ROLLBACK
            conn.execute("RESET plan_cache_mode")
        title = "custom plan" if mode == "custom" else "generic plan (force_generic_plan)"
        print(f"\n===== {label}: {title}, execution {runs} of {runs}")
        print("\n".join(plan))
        if plan_ms:
            print(f"(custom planning, median of {len(plan_ms)}: "
                  f"{statistics.median(plan_ms):.3f} ms; paid on every execution while "
                  "PostgreSQL keeps choosing custom plans)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", metavar="URL")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args(argv)
    with server(args.database_url) as found:
        show(found.url, args)
    return 0


def show(server_url: str, args: argparse.Namespace) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    database = create_database(psycopg_url(server_url), "pgtask_explain")
    engine = create_engine(database)
    conninfo = make_url(database).set(drivername="postgresql").render_as_string(
        hide_password=False
    )
    try:
        upgrade(database)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgtask.tasks")
            conn.execute("VACUUM ANALYZE pgtask.attempts")
        for start in range(0, args.tasks, 1000):
            with Session(engine) as session:
                enqueue_many(session, [
                    EnqueueRequest(name="noop", payload={"i": i})
                    for i in range(start, min(args.tasks, start + 1000))
                ])
                session.commit()
        worker = uuid.uuid4()
        # No automatic preparing: this session PREPAREs and DEALLOCATEs by itself.
        with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as conn:
            conn.execute("ANALYZE pgtask.tasks")
            done = 0
            while done < args.tasks // 2:
                rows = execute(conn, statements.CLAIM, claim_params(args.batch, worker))
                execute(conn, statements.COMPLETE, dict(
                    statements.complete_params(leases(rows), ["null"] * len(rows))
                ))
                done += len(rows)
            running = execute(conn, statements.CLAIM, claim_params(args.batch, worker))
            held = leases(running)
            print(f"{args.tasks} tasks enqueued, {done} claimed and completed, "
                  f"{len(running)} running; statistics from before the drain.")
            explain(conn, "CLAIM", statements.CLAIM, claim_params(args.batch, worker))
            explain(conn, "COMPLETE", statements.COMPLETE,
                    dict(statements.complete_params(held, ["null"] * len(held))))
            explain(conn, "FAIL", statements.FAIL, dict(statements.fail_params(
                held, ['{"type": "x"}'] * len(held), [1.0] * len(held)
            )))
            explain(conn, "RENEW", statements.RENEW, dict(statements.renew_params(held, 30.0)))
            explain(conn, "RECOVER", statements.RECOVER, {"limit": 100})
            explain(conn, "SECONDS_UNTIL_DUE", statements.SECONDS_UNTIL_DUE, dict(CAPABILITIES))
    finally:
        engine.dispose()
        drop_database(database)


if __name__ == "__main__":
    sys.exit(main())
