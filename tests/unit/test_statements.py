"""The hot statements, compiled for psycopg: the SQL shapes the planner and the fence rely on.

No database: these check what is sent. ``tests/integration/test_fencing.py`` proves what the
same statements do.
"""

from __future__ import annotations

import re
from typing import Any, cast

import pytest
from sqlalchemy import DateTime
from sqlalchemy.dialects.postgresql import psycopg
from sqlalchemy.sql.compiler import SQLCompiler

from sqlalchemy_pgtask import Registry, RetryPolicy, statements
from sqlalchemy_pgtask.worker import Worker

DIALECT = psycopg.dialect()  # type: ignore[no-untyped-call]

#: Everything the worker runs on a schedule or per task.
WORKER_STATEMENTS = {
    "CLAIM": statements.CLAIM,
    "RENEW": statements.RENEW,
    "COMPLETE": statements.COMPLETE,
    "FAIL": statements.FAIL,
    "RELEASE": statements.RELEASE,
    "RECOVER": statements.RECOVER,
    "CANCEL": statements.CANCEL,
    "SECONDS_UNTIL_DUE": statements.SECONDS_UNTIL_DUE,
    "REGISTER_WORKER": statements.REGISTER_WORKER,
    "HEARTBEAT": statements.HEARTBEAT,
    "RETIRE_WORKER": statements.RETIRE_WORKER,
}
FENCED = ("RENEW", "COMPLETE", "FAIL", "RELEASE")
#: What ``Worker._execute_outcomes`` and ``Worker._renew`` bind, per statement.
FENCED_PARAMETERS = {
    "RENEW": {"ids", "attempts", "tokens", "running", "lease_seconds"},
    "COMPLETE": {"ids", "attempts", "tokens", "running", "results"},
    "FAIL": {"ids", "attempts", "tokens", "running", "errors", "delays"},
    "RELEASE": {"ids", "attempts", "tokens", "running"},
}


def compiled(name: str) -> SQLCompiler:
    return cast(SQLCompiler, WORKER_STATEMENTS[name].compile(dialect=DIALECT))


def sql(name: str) -> str:
    return " ".join(compiled(name).string.split())  # one line, single spaces


def required_parameters(name: str) -> dict[str, Any]:
    """The parameters a caller must bind (internal literals are not among them)."""
    return {
        key: bind.type for key, bind in compiled(name).binds.items() if bind.required
    }


def fenced_update_where(name: str) -> list[str]:
    """The conjuncts of the WHERE clause of the statement's UPDATE of ``pgtask.tasks``."""
    match = re.search(r"UPDATE pgtask\.tasks SET .*? WHERE (.*?) RETURNING", sql(name))
    assert match is not None, sql(name)
    return [part.strip() for part in match.group(1).split(" AND ")]


# -- CLAIM ---------------------------------------------------------------------------------


def test_claim_skips_rows_locked_by_other_claimers_without_blocking_foreign_keys() -> None:
    assert "FOR NO KEY UPDATE SKIP LOCKED" in sql("CLAIM")


def test_claim_filters_pending_with_a_literal_so_the_partial_claim_index_matches() -> None:
    text = sql("CLAIM")
    assert "pgtask.tasks.state = 'pending'" in text
    assert "state = %(" not in text.split("claimed AS")[0]  # no bound state in the pick


def test_claim_updates_through_any_array_of_the_picked_ids() -> None:
    assert "pgtask.tasks.id = ANY (array((SELECT picked.id FROM picked)))" in sql("CLAIM")


def test_claim_picks_due_tasks_by_priority_then_run_at_within_the_limit() -> None:
    picked = sql("CLAIM").split("picked AS")[1].split("claimed AS")[0]
    assert "pgtask.tasks.run_at <= statement_timestamp()" in picked
    assert re.search(
        r"ORDER BY pgtask\.tasks\.priority DESC, pgtask\.tasks\.run_at, pgtask\.tasks\.id "
        r"LIMIT %\(limit\)s",
        picked,
    )
    assert "(pgtask.tasks.name, pgtask.tasks.version) IN (SELECT capabilities.name" in picked
    assert "pgtask.queues.paused_at IS NOT NULL" in picked


def test_claim_sets_the_lease_expiry_from_database_time() -> None:
    assert re.search(
        r"lease_expires_at=\(statement_timestamp\(\) \+ make_interval\(0, 0, 0, 0, 0, 0, "
        r"%\(lease_seconds\)s\)\)",
        sql("CLAIM"),
    )


def test_claim_binds_exactly_what_the_worker_passes() -> None:
    registry = Registry()
    registry.task("report", retry=RetryPolicy.fixed(1.0))(lambda ctx, payload: None)
    worker = Worker(registry, "postgresql+psycopg://nobody@localhost/none")  # no I/O
    passed = set(worker._claim_parameters("default")) | {"limit"}
    assert set(required_parameters("CLAIM")) == passed


# -- fenced transitions --------------------------------------------------------------------


@pytest.mark.parametrize("name", FENCED)
def test_fenced_statements_match_id_attempt_lease_token_and_a_bound_state(name: str) -> None:
    where = fenced_update_where(name)
    assert "pgtask.tasks.id = request.id" in where
    assert "pgtask.tasks.attempt = request.attempt" in where
    assert "pgtask.tasks.lease_token = request.token" in where
    # A scalar subquery rather than a plain parameter: not even a custom plan can then match
    # the partial lease index (which would walk every running row for each row of the batch).
    assert any(
        re.fullmatch(r"pgtask\.tasks\.state = \(SELECT %\(running\)s(::\w+)? AS anon_\d+\)", c)
        for c in where
    )
    # The id list also probes the primary key directly.
    assert any(re.fullmatch(r"pgtask\.tasks\.id = ANY \(%\(ids\)s(::UUID\[\])?\)", c)
               for c in where)


@pytest.mark.parametrize("name", FENCED)
def test_fenced_statements_never_use_a_literal_running_state(name: str) -> None:
    # A literal would match the partial lease index and the plan would then nested-loop every
    # running row against the batch.
    assert "'running'" not in sql(name)


@pytest.mark.parametrize("name", FENCED)
def test_fenced_statements_take_each_attempt_from_the_bound_arrays(name: str) -> None:
    assert re.search(
        r"FROM unnest\(%\(ids\)s::UUID\[\], %\(attempts\)s::INTEGER\[\], "
        r"%\(tokens\)s::UUID\[\]",
        sql(name),
    )


@pytest.mark.parametrize("name", FENCED)
def test_fenced_statements_bind_exactly_what_the_worker_passes(name: str) -> None:
    assert set(required_parameters(name)) == FENCED_PARAMETERS[name]


@pytest.mark.parametrize("name", ["COMPLETE", "FAIL", "RELEASE"])
def test_finishing_statements_record_the_attempt_in_the_same_statement(name: str) -> None:
    text = sql(name)
    assert "UPDATE pgtask.attempts SET" in text
    assert "pgtask.attempts.task_id = done.id AND pgtask.attempts.attempt = done.attempt" in text


def test_renew_extends_the_lease_from_database_time_and_reports_cancellation() -> None:
    text = sql("RENEW")
    assert re.search(
        r"SET lease_expires_at=\(statement_timestamp\(\) \+ make_interval\(0, 0, 0, 0, 0, 0, "
        r"%\(lease_seconds\)s\)\)",
        text,
    )
    assert "RETURNING pgtask.tasks.id, pgtask.tasks.cancel_requested_at IS NOT NULL" in text


def test_fail_schedules_the_retry_from_database_time_plus_the_bound_delay() -> None:
    assert "statement_timestamp() + make_interval(0, 0, 0, 0, 0, 0, request.delay)" in sql(
        "FAIL"
    )


# -- recovery ------------------------------------------------------------------------------


def test_recover_finds_expired_leases_by_database_time_and_skips_locked_rows() -> None:
    text = sql("RECOVER")
    # Recovery is not fenced by a token: it matches the partial lease index on purpose.
    assert "pgtask.tasks.state = 'running' AND pgtask.tasks.lease_expires_at <= " \
           "statement_timestamp()" in text
    assert "FOR NO KEY UPDATE SKIP LOCKED" in text
    assert "pgtask.tasks.id = ANY (array((SELECT expired.id FROM expired)))" in text
    assert set(required_parameters("RECOVER")) == {"limit"}


# -- database time only --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(WORKER_STATEMENTS))
def test_worker_statements_take_no_time_from_the_client(name: str) -> None:
    parameters = required_parameters(name)
    for key, type_ in parameters.items():
        assert not isinstance(type_, DateTime), f"{name} binds a client time as {key!r}"
        assert not key.endswith("_at"), f"{name} binds {key!r}"
        assert "now" not in key
    text = sql(name).lower()
    for clock in ("now()", "current_timestamp", "clock_timestamp", "transaction_timestamp",
                  "localtimestamp"):
        assert clock not in text, f"{name} reads {clock}"


@pytest.mark.parametrize(
    "name",
    ["CLAIM", "RENEW", "COMPLETE", "FAIL", "RELEASE", "RECOVER", "CANCEL", "SECONDS_UNTIL_DUE",
     "REGISTER_WORKER", "HEARTBEAT", "RETIRE_WORKER"],
)
def test_statements_that_set_or_compare_deadlines_use_statement_timestamp(name: str) -> None:
    assert "statement_timestamp()" in sql(name)
