"""Future work costs nothing: tasks due later never slow the claim or the idle worker's sleep.

A claim that comes up short (fewer due tasks than it asks for: every claim of an idle worker
woken for one task) used to walk every future entry of its queue in ``ix_tasks_claim``,
because that index leads with the priority and PostgreSQL 15 cannot skip from one priority to
the next: 2.1 ms per wake-up with 200,000 tasks due in an hour. The claim now reads each
priority's due entries as a range. The figures here are buffers read (a count, not a time),
under the worker's own planner settings and a plan cached while many tasks were due.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, text

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements.claim import (
    CLAIM,
    Capability,
    capability_params,
    claim_params,
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


class _Claimer:
    """A connection with the worker's planner settings and the claim prepared (cached as a
    generic plan at its first execution, as on the worker's held connection)."""

    def __init__(self, url: str, limit: int) -> None:
        values = claim_params(
            _CAPABILITIES, worker_id=uuid.uuid4(), lease_seconds=30.0, limit=limit
        )
        query, self._values = _positional(CLAIM, values)
        self._conn = psycopg.connect(libpq_url(url), autocommit=True)
        for name, value in PLANNER_SETTINGS:
            self._conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        self._conn.execute(sql.SQL("PREPARE claim AS {}").format(sql.SQL(query)))
        self._args = sql.SQL(", ").join(
            sql.Literal(json.dumps(v) if isinstance(v, dict) else v) for v in self._values
        )

    def claim(self) -> int:
        rows = self._conn.execute(sql.SQL("EXECUTE claim({})").format(self._args)).fetchall()
        return len(rows)

    def explain(self) -> tuple[int, int, str]:
        """Claim once under EXPLAIN ANALYZE: (rows claimed, buffers read, the plan)."""
        query = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim({})").format(
            self._args
        )
        plan = self._conn.execute(query).fetchone()
        assert plan is not None
        document: list[dict[str, Any]] = plan[0]
        return int(document[0]["Plan"]["Actual Rows"]), _buffers(document), json.dumps(document)

    def close(self) -> None:
        self._conn.close()


def _short_claim_buffers(engine: Engine, url: str, future: int, priorities: int) -> int:
    """Buffers a claim of 50 reads once the due tasks are gone, ``future`` tasks due later."""
    _add(engine, 2_000, due=True, priorities=priorities)
    _add(engine, future, due=False, priorities=priorities)
    claimer = _Claimer(url, limit=50)
    try:
        while claimer.claim():  # the plan is cached while many tasks are due
            pass
        # Without the entries the drain left dead, what is left to read is the live ones.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM pgtask.tasks"))
        _add(engine, 3, due=True, priorities=priorities)
        claimed, buffers, plan = claimer.explain()
        assert claimed == 3, plan
        return buffers
    finally:
        claimer.close()


def _compare(engine: Engine, url: str, priorities: int) -> tuple[int, int]:
    without = _short_claim_buffers(engine, url, 0, priorities)
    with engine.begin() as connection:
        connection.execute(text("TRUNCATE pgtask.tasks CASCADE"))
    return without, _short_claim_buffers(engine, url, 40_000, priorities)


def test_a_short_claim_reads_the_same_with_40000_future_tasks_as_with_none(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    without, with_future = _compare(pgtask_engine, pgtask_database_url, priorities=1)
    # 40,000 future entries fill about 150 leaf pages of the claim index: a walk reads them.
    assert with_future <= without + 20, (without, with_future)


def test_a_short_claim_skips_the_future_tasks_of_every_priority(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    without, with_future = _compare(pgtask_engine, pgtask_database_url, priorities=4)
    assert with_future <= without + 20, (without, with_future)


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
