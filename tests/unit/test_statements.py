"""The hot statements, compiled for psycopg: the SQL shapes the planner and the fence rely on.

No database: these check what is sent. ``tests/integration/test_fencing.py`` proves what the
same statements do.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH
from sqlalchemy import DateTime
from sqlalchemy.dialects.postgresql import psycopg
from sqlalchemy.sql.compiler import SQLCompiler

from sqlalchemy_pgtask import RetryPolicy, statements

# SQLAlchemy's dialect classes have unannotated constructors.
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
    "PRUNE_WORKERS": statements.PRUNE_WORKERS,
    "LEASES": statements.LEASES,
    "OWNED": statements.OWNED,
    # Durable calls and their maintenance.
    "CHECKPOINTS": statements.CHECKPOINTS,
    "CHECKPOINT": statements.CHECKPOINT,
    "FENCE_STATE": statements.FENCE_STATE,
    "SAVE_CHECKPOINT": statements.SAVE_CHECKPOINT,
    "SLEEP": statements.SLEEP,
    "SPAWN": statements.SPAWN,
    "LOCK_FOR_WAIT": statements.LOCK_FOR_WAIT,
    "REGISTER_SIGNAL_WAIT": statements.REGISTER_SIGNAL_WAIT,
    "LOCK_CHILD": statements.LOCK_CHILD,
    "REGISTER_RESULT_WAIT": statements.REGISTER_RESULT_WAIT,
    "WAIT_TIMEOUTS": statements.WAIT_TIMEOUTS,
    "WAIT_TIMEOUT": statements.WAIT_TIMEOUT,
    "DUE_WAITS": statements.DUE_WAITS,
    "NEXT_WAIT_TIMEOUT": statements.NEXT_WAIT_TIMEOUT,
    "EMIT_SIGNAL": statements.EMIT_SIGNAL,
    # Only for workers with governed queues (rate limits, starvation timeouts).
    "CLAIM_GOVERNED": statements.CLAIM_GOVERNED,
    "SECONDS_UNTIL_DUE_GOVERNED": statements.SECONDS_UNTIL_DUE_GOVERNED,
    "GOVERNED_QUEUES": statements.GOVERNED_QUEUES,
}
#: Longer than psycopg caches parsing for, and run only by workers that need them.
LONG_STATEMENTS = {"CLAIM_GOVERNED"}
#: The durable statements that are fenced by an attempt's lease, and what else they bind.
DURABLE_FENCED = {
    "SAVE_CHECKPOINT": {"kind", "value"},
    "SLEEP": {"delay", "wake_at"},
    "SPAWN": {
        "child_id", "child_queue", "child_name", "child_version", "child_payload",
        "child_headers", "child_priority", "child_max_attempts", "child_run_at", "child_delay",
        "child_timeout", "child_concurrency_key", "child_concurrency_limit",
    },
    "REGISTER_SIGNAL_WAIT": {"signal", "signal_occurrence", "timeout"},
    "REGISTER_RESULT_WAIT": {"child_id", "timeout"},
}
FENCED = ("RENEW", "COMPLETE", "FAIL", "RELEASE")
LEASES = [statements.Lease(uuid.uuid4(), 1, uuid.uuid4())]
CAPABILITIES = statements.capability_params(
    ["default"], [statements.Capability("default", "report", 1, RetryPolicy.fixed(1.0), 5)]
)
#: What each builder makes: the parameters the worker binds, and nothing else.
BUILT: dict[str, Mapping[str, object]] = {
    "CLAIM": statements.claim_params(
        CAPABILITIES, worker_id=uuid.uuid4(), lease_seconds=30.0, limit=10
    ),
    "SECONDS_UNTIL_DUE": CAPABILITIES,
    "CLAIM_GOVERNED": statements.claim_params(
        CAPABILITIES, worker_id=uuid.uuid4(), lease_seconds=30.0, limit=10
    ),
    "SECONDS_UNTIL_DUE_GOVERNED": CAPABILITIES,
    "RENEW": statements.renew_params(LEASES, 30.0),
    "COMPLETE": statements.complete_params(LEASES, ["1"]),
    "FAIL": statements.fail_params(LEASES, ["{}"], [1]),
    "RELEASE": statements.release_params(LEASES),
}


def compiled(name: str) -> SQLCompiler:
    result = WORKER_STATEMENTS[name].compile(dialect=DIALECT)
    assert isinstance(result, SQLCompiler)
    return result


def sql(name: str) -> str:
    return " ".join(compiled(name).string.split())  # one line, single spaces


def required_parameters(name: str) -> dict[str, Any]:
    """The parameters a caller must bind (internal literals and defaults are not among them)."""
    return {
        key: bind.type for key, bind in compiled(name).binds.items() if bind.required
    }


def held_cte(name: str) -> str:
    """The fenced statement's CTE that picks and locks the rows whose lease still holds."""
    match = re.search(r"held AS \((SELECT .*? SKIP LOCKED)\)", sql(name))
    assert match is not None, sql(name)
    return match.group(1)


def held_where(name: str) -> list[str]:
    match = re.search(r" WHERE (.*?) FOR NO KEY UPDATE", held_cte(name))
    assert match is not None
    return [part.strip() for part in match.group(1).split(" AND ")]


# -- CLAIM ---------------------------------------------------------------------------------


def test_claim_skips_rows_locked_by_other_claimers_without_blocking_foreign_keys() -> None:
    assert "FOR NO KEY UPDATE SKIP LOCKED" in sql("CLAIM")


def test_claim_filters_pending_with_a_literal_so_the_partial_claim_index_matches() -> None:
    text = sql("CLAIM")
    assert "c.state = 'pending'" in text
    assert "state = %(" not in text.split("claimed AS")[0]  # no bound state in the pick


def test_claim_updates_through_any_array_of_the_picked_ids() -> None:
    assert "t.id = ANY (array((SELECT picked.id FROM picked)))" in sql("CLAIM")


def test_claim_probes_each_served_queue_by_priority_then_run_at_within_the_limit() -> None:
    picked = sql("CLAIM").split("picked AS")[1].split("claimed AS")[0]
    assert "JOIN LATERAL (SELECT" in picked  # one index probe per queue, in one statement
    assert "FROM pgtask.tasks AS c WHERE" in picked
    assert "c.queue = served.name" in picked
    assert "c.run_at <= pgtask.now()" in picked
    assert re.search(
        r"ORDER BY c\.priority DESC, c\.run_at, c\.id "
        r"LIMIT %\(limit\)s::INTEGER FOR NO KEY UPDATE SKIP LOCKED",
        picked,
    )
    # Earlier queues of the worker first, then the same order across queues.
    assert re.search(
        r"ORDER BY served\.ord, candidate\.priority DESC, candidate\.run_at, candidate\.id "
        r"LIMIT %\(limit\)s",
        picked,
    )
    assert "(c.name, c.version) IN (SELECT capabilities.name" in picked
    assert "WHERE c.queue = capabilities.queue" in picked


def test_claim_skips_paused_and_governed_queues() -> None:
    served = sql("CLAIM").split("served AS")[1].split("picked AS")[0]
    assert "WITH ORDINALITY AS served(name, ord)" in served
    assert "q.paused_at IS NOT NULL" in served
    assert "q.rate_limit IS NOT NULL" in served
    assert "q.starvation_timeout_seconds IS NOT NULL" in served


def test_governed_claim_serves_unpaused_queues_with_their_limits() -> None:
    served = sql("CLAIM_GOVERNED").split("served AS")[1].split("buckets AS")[0]
    assert "LEFT OUTER JOIN pgtask.queues" in served
    assert "pgtask.queues.paused_at IS NULL" in served
    buckets = sql("CLAIM_GOVERNED").split("buckets AS")[1].split("allowance AS")[0]
    assert "FOR UPDATE OF rate_buckets" in buckets


def test_claim_sets_the_lease_expiry_from_database_time() -> None:
    assert re.search(
        r"lease_expires_at=\(pgtask\.now\(\) \+ make_interval\(0, 0, 0, 0, 0, 0, "
        r"%\(lease_seconds\)s\)\)",
        sql("CLAIM"),
    )


def test_claim_fills_an_unset_max_attempts_from_the_capability() -> None:
    assert "max_attempts=coalesce(t.max_attempts, capabilities.max_attempts)" in sql("CLAIM")


@pytest.mark.parametrize("name", sorted(set(WORKER_STATEMENTS) - LONG_STATEMENTS))
def test_worker_statements_stay_under_psycopgs_limit_for_cached_parsing(name: str) -> None:
    # psycopg parses a query text of at most 4 KiB once and caches it; a longer one is parsed
    # again on every execution (measured: a claim 40 bytes over the limit cost ~10% of a drain).
    assert len(compiled(name).string.encode()) <= MAX_CACHED_STATEMENT_LENGTH


@pytest.mark.parametrize("name", sorted(BUILT))
def test_each_builder_makes_exactly_the_parameters_its_statement_binds(name: str) -> None:
    assert set(BUILT[name]) == set(required_parameters(name))


@pytest.mark.parametrize("name", sorted(WORKER_STATEMENTS))
def test_no_parameter_is_named_like_a_column_an_update_would_then_set(name: str) -> None:
    # SQLAlchemy adds a bound parameter named like a column of an UPDATE's table to that
    # UPDATE's SET list (even inside a CTE): a "version" parameter would rewrite the task's.
    statement = WORKER_STATEMENTS[name]
    keys = list(required_parameters(name))
    assert statement.compile(dialect=DIALECT, column_keys=keys).string == compiled(name).string


@pytest.mark.parametrize("name", sorted(DURABLE_FENCED))
def test_durable_writes_bind_the_fence_the_step_key_and_their_own_values(name: str) -> None:
    lease = statements.Lease(uuid.uuid4(), 2, uuid.uuid4())
    fence = set(statements.durable_params(lease, 1, "step", 0))
    assert set(required_parameters(name)) == fence | DURABLE_FENCED[name]


@pytest.mark.parametrize("name", ["SAVE_CHECKPOINT", "SLEEP", "SPAWN", "LOCK_FOR_WAIT"])
def test_durable_writes_lock_the_task_row_they_are_fenced_on(name: str) -> None:
    text = sql(name)
    where = (
        "pgtask.tasks.id = %(task)s::UUID AND pgtask.tasks.state = (SELECT %(running)s"
    )
    assert where in text
    fence = (
        "pgtask.tasks.attempt = %(attempt_number)s::INTEGER AND "
        "pgtask.tasks.lease_token = %(token)s::UUID"
    )
    assert fence in text
    mode = {
        "SAVE_CHECKPOINT": "FOR SHARE", "SLEEP": "FOR NO KEY UPDATE",
        "SPAWN": "FOR NO KEY UPDATE", "LOCK_FOR_WAIT": "FOR UPDATE OF tasks",
    }[name]
    assert mode in text
    assert "SKIP LOCKED" not in text


# -- fenced transitions --------------------------------------------------------------------


@pytest.mark.parametrize("name", FENCED)
def test_fenced_statements_lock_their_rows_skipping_rows_others_hold(name: str) -> None:
    held = held_cte(name)
    assert held.startswith("SELECT pgtask.tasks.id AS id FROM pgtask.tasks JOIN unnest(")
    assert held.endswith("FOR NO KEY UPDATE OF tasks SKIP LOCKED")
    assert "pgtask.tasks.id = ANY (array((SELECT held.id FROM held)))" in sql(name)


@pytest.mark.parametrize("name", FENCED)
def test_fenced_statements_match_id_attempt_lease_token_and_a_bound_state(name: str) -> None:
    where = held_where(name)
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
def test_the_fence_state_is_a_bound_default_nobody_passes(name: str) -> None:
    bind = compiled(name).binds["running"]
    assert (bind.value, bind.required) == ("running", False)


@pytest.mark.parametrize("name", ["COMPLETE", "FAIL", "RELEASE"])
def test_finishing_statements_record_the_attempt_in_the_same_statement(name: str) -> None:
    text = sql(name)
    assert "UPDATE pgtask.attempts SET" in text
    assert "pgtask.attempts.task_id = done.id AND pgtask.attempts.attempt = done.attempt" in text


def test_renew_extends_the_lease_from_database_time_and_reports_cancellation() -> None:
    text = sql("RENEW")
    assert re.search(
        r"SET lease_expires_at=\(pgtask\.now\(\) \+ make_interval\(0, 0, 0, 0, 0, 0, "
        r"%\(lease_seconds\)s\)\)",
        text,
    )
    assert "RETURNING pgtask.tasks.id, pgtask.tasks.cancel_requested_at IS NOT NULL" in text


def test_fail_schedules_the_retry_from_database_time_plus_the_bound_delay() -> None:
    assert "pgtask.now() + make_interval(0, 0, 0, 0, 0, 0, request.delay)" in sql("FAIL")


# -- recovery ------------------------------------------------------------------------------


def test_recover_finds_expired_leases_by_database_time_and_skips_locked_rows() -> None:
    text = sql("RECOVER")
    # Recovery is not fenced by a token: it matches the partial lease index on purpose.
    assert "pgtask.tasks.state = 'running' AND pgtask.tasks.lease_expires_at <= " \
           "pgtask.now()" in text
    assert "FOR NO KEY UPDATE SKIP LOCKED" in text
    assert "pgtask.tasks.id = ANY (array((SELECT expired.id FROM expired)))" in text
    assert set(required_parameters("RECOVER")) == {"limit"}


# -- database time only --------------------------------------------------------------------


#: Instants a handler chose itself (``sleep_until(when)``, a child's ``run_at``): the user's
#: own deadlines, compared with database time, never a reading of the worker's clock.
CHOSEN_INSTANTS = {("SLEEP", "wake_at"), ("SPAWN", "child_run_at")}


@pytest.mark.parametrize("name", sorted(WORKER_STATEMENTS))
def test_worker_statements_take_no_time_from_the_client(name: str) -> None:
    parameters = required_parameters(name)
    for key, type_ in parameters.items():
        if (name, key) in CHOSEN_INSTANTS:
            continue
        assert not isinstance(type_, DateTime), f"{name} binds a client time as {key!r}"
        assert not key.endswith("_at"), f"{name} binds {key!r}"
        assert "now" not in key
    text = sql(name).lower().replace("pgtask.now()", "")
    for clock in ("now()", "current_timestamp", "clock_timestamp", "transaction_timestamp",
                  "localtimestamp", "statement_timestamp"):
        assert clock not in text, f"{name} reads {clock} instead of pgtask.now()"


@pytest.mark.parametrize(
    "name",
    ["CLAIM", "RENEW", "COMPLETE", "FAIL", "RELEASE", "RECOVER", "CANCEL", "SECONDS_UNTIL_DUE",
     "REGISTER_WORKER", "HEARTBEAT", "RETIRE_WORKER", "PRUNE_WORKERS"],
)
def test_statements_that_set_or_compare_deadlines_use_the_one_database_clock(name: str) -> None:
    assert "pgtask.now()" in sql(name)
