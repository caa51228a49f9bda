"""Future work costs nothing: tasks due later never slow the idle worker's sleep.

The "seconds until due" query probes ``ix_tasks_pending_run_at`` once per queue, whatever
the number of future tasks. (The claim's own walk over future entries when it comes up
short is not fixed yet: see docs/performance.md.) The figure is buffers read, not a time.
"""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, text

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements.claim import (
    Capability,
    capability_params,
)
from sqlalchemy_pgtask.worker._reconnect import PLANNER_SETTINGS
from tests.integration.test_plans import _positional
from tests.support.urls import libpq_url

_CAPABILITIES = capability_params(
    ["default"], [Capability("default", "t", 1, RetryPolicy.never(), 5)]
)


def _add(engine: Engine, count: int, *, due: bool, priorities: int = 1) -> None:
    when = "- interval '1 second'" if due else "+ interval '1 hour'"
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO pgtask.tasks (queue, name, payload, priority, run_at) "
                f"SELECT 'default', 't', 'null', g % :p, statement_timestamp() {when} "
                "FROM generate_series(1, :n) AS g"
            ),
            {"n": count, "p": priorities},
        )
        connection.execute(text("ANALYZE pgtask.tasks"))


def _buffers(plan: list[dict[str, Any]]) -> int:
    top = plan[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_the_idle_sleep_reads_one_entry_per_queue_with_40000_future_tasks(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    _add(pgtask_engine, 40_000, due=False)
    query, values = _positional(statements.SECONDS_UNTIL_DUE, dict(_CAPABILITIES))
    with psycopg.connect(libpq_url(pgtask_database_url), autocommit=True) as conn:
        for name, value in PLANNER_SETTINGS:
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        conn.execute(sql.SQL("PREPARE due AS {}").format(sql.SQL(query)))
        args = sql.SQL(", ").join(sql.Literal(v) for v in values)
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE due({})").format(args)
        ).fetchone()
    assert row is not None
    plan = json.dumps(row[0])
    assert re.search(r"ix_tasks_pending_run_at", plan), plan
    assert _buffers(row[0]) < 20, plan
