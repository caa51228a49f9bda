"""The hot statements keep probing indexes after their tables grow under a cached plan.

A plan cached while ``pgtask.tasks`` or ``pgtask.attempts`` was nearly empty used to scan it
sequentially for every outcome written, long after it held thousands of rows (seconds per
statement in the drain benchmark). The worker's hot connections run with planner settings that
rule that out.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import ClauseElement

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.worker._reconnect import PLANNER_SETTINGS
from tests.support.urls import libpq_url


def _positional(statement: ClauseElement, values: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """The statement with ``$n`` placeholders (for PREPARE), and its values in order."""
    # SQLAlchemy's dialect classes have unannotated constructors.
    dialect = postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]
    compiled = statement.compile(dialect=dialect)
    params = {**compiled.params, **values}
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return re.sub(r"%\((\w+)\)s", number, str(compiled)), [params[n] for n in names]


def _explain(cursor: psycopg.Cursor[Any], values: list[Any]) -> str:
    query = sql.SQL("EXPLAIN EXECUTE hot({})").format(
        sql.SQL(", ").join(sql.Literal(v) for v in values)
    )
    return "\n".join(row[0] for row in cursor.execute(query).fetchall())


def _claim_many(engine: Engine, count: int) -> None:
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO pgtask.tasks (id, queue, name, payload) "
                "SELECT gen_random_uuid(), 'default', 't', 'null' FROM generate_series(1, :n)"
            ),
            {"n": count},
        )
        connection.execute(
            text(
                "WITH c AS (UPDATE pgtask.tasks SET state = 'running', attempt = 1, "
                "max_attempts = 5, "
                "lease_token = gen_random_uuid(), lease_owner = gen_random_uuid(), "
                "lease_expires_at = now() + interval '1 hour' RETURNING id, lease_token) "
                "INSERT INTO pgtask.attempts (task_id, attempt, lease_token) "
                "SELECT id, 1, lease_token FROM c"
            )
        )


def _plan_after_growth(engine: Engine, url: str, settings: tuple[tuple[str, str], ...]) -> str:
    values = statements.complete_params([statements.Lease(uuid.uuid4(), 1, uuid.uuid4())], ["null"])
    query, ordered = _positional(statements.COMPLETE, values)
    with psycopg.connect(
        libpq_url(url), autocommit=True, cursor_factory=psycopg.ClientCursor
    ) as conn:
        cursor = conn.cursor()
        for name, value in settings:
            cursor.execute("SELECT set_config(%s, %s, false)", (name, value))
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute(sql.SQL("PREPARE hot AS {}").format(sql.SQL(query)))
        _explain(cursor, ordered)  # the plan is cached now, while the tables are empty
        _claim_many(engine, 3000)
        return _explain(cursor, ordered)


def test_the_cached_outcome_plan_would_scan_a_grown_table_without_the_worker_settings(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    # The trap is real: this is what the settings below prevent.
    plan = _plan_after_growth(pgtask_engine, pgtask_database_url, ())
    assert re.search(r"Seq Scan on (pgtask\.)?(tasks|attempts)", plan), plan


def test_the_cached_outcome_plan_probes_indexes_under_the_worker_settings(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    plan = _plan_after_growth(pgtask_engine, pgtask_database_url, PLANNER_SETTINGS)
    assert "Seq Scan" not in plan, plan
    assert "pk_attempts" in plan, plan
    assert "pk_tasks" in plan, plan


def test_the_worker_settings_never_compile_a_statement_with_jit(pgtask_engine: Engine) -> None:
    # The seqscan penalty lifts any plan that needs a scan (the small workers table, which
    # the rescue pass reads) far above jit_above_cost: with JIT on, PostgreSQL would compile
    # that plan on every execution (~0.7 s here) for a statement that runs in a millisecond.
    from sqlalchemy_pgtask.statements.rescue import WORKER_LOCKS

    query = str(WORKER_LOCKS.compile(dialect=pgtask_engine.dialect))
    with pgtask_engine.connect() as conn:
        if not conn.execute(text("SELECT pg_jit_available()")).scalar_one():
            pytest.skip("this PostgreSQL server was built without JIT")
        conn.execute(text("SET jit = on"))
        conn.execute(text("SET jit_above_cost = 100000"))
        for name, value in PLANNER_SETTINGS:
            conn.execute(text(f"SET {name} = {value}"))
        plan = "\n".join(row[0] for row in conn.execute(text(f"EXPLAIN (ANALYZE) {query}")))
    assert "JIT:" not in plan
