"""The statements sent to psycopg as text compiled once (`sqlalchemy_pgtask._driver_sql`) send
what SQLAlchemy's compiled path sends: the same SQL and the same parameter values, of the same
types, for the parameters the library's own builders produce; only arrays of plain element
types go in psycopg's binary format, which the server reads as the same values."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.sql.base import Executable

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._driver_sql import driver_statement, execute
from sqlalchemy_pgtask.enqueue.plan import EnqueueRequest, plan_many, validate_many
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements import Capability, Lease, capability_params, claim_params

CAPABILITIES = capability_params(
    ["default", "q2"],
    [
        Capability("default", "echo", 1, RetryPolicy.fixed(2.0), 5, 30.0),
        Capability("q2", "x", 2, RetryPolicy.never(), 3, None),
        Capability("q2", "y", 1, RetryPolicy.fixed(1.5, jitter=False), 7, 12.5),
    ],
)
LEASES = [Lease(uuid.uuid4(), 1, uuid.uuid4()), Lease(uuid.uuid4(), 3, uuid.uuid4())]


def _plan(*requests: EnqueueRequest) -> tuple[Executable, dict[str, Any]]:
    plan = plan_many(validate_many(requests))
    return plan.statement, dict(plan.params)


CLAIM = claim_params(CAPABILITIES, worker_id=uuid.uuid4(), lease_seconds=30.0, limit=10)
CASES: dict[str, tuple[Executable, Any]] = {
    "CLAIM": (statements.CLAIM, CLAIM),
    "CLAIM_GOVERNED": (statements.CLAIM_GOVERNED, CLAIM),
    "SECONDS_UNTIL_DUE": (statements.SECONDS_UNTIL_DUE, CAPABILITIES),
    "SECONDS_UNTIL_DUE_GOVERNED": (statements.SECONDS_UNTIL_DUE_GOVERNED, CAPABILITIES),
    "COMPLETE": (statements.COMPLETE, statements.complete_params(LEASES, ['{"x": 1}', "null"])),
    "FAIL": (
        statements.FAIL,
        statements.fail_params(LEASES, ['{"type": "e"}', '{"type": "f"}'], [1.0, None]),
    ),
    "RELEASE": (statements.RELEASE, statements.release_params(LEASES, [0.0, 2.5])),
    "ENQUEUE_PLAIN": _plan(EnqueueRequest(name="t", payload={"a": 1})),
    "ENQUEUE_ONE": _plan(EnqueueRequest(name="t", payload={"a": 1}, priority=3)),
    "ENQUEUE_UNIFORM": _plan(*(EnqueueRequest(name="t", payload={"a": i}) for i in range(3))),
    "ENQUEUE_BATCH": _plan(
        EnqueueRequest(name="t", payload=1, priority=3, run_at=datetime.now(timezone.utc)),
        EnqueueRequest(name="u", queue="q2", delay=5.0, timeout=3.0, headers={"h": "1"}),
    ),
    "ENQUEUE_BATCH_IDEMPOTENT": _plan(
        EnqueueRequest(name="t", payload=1, idempotency_key="k1"),
        EnqueueRequest(name="t", payload=2),
    ),
    "TAKE_OVER_KEYS": (
        statements.TAKE_OVER_KEYS,
        # The arrays of ENQUEUE_BATCH_IDEMPOTENT's plan: the take-over inserts their tasks.
        _plan(
            EnqueueRequest(name="t", payload=1, idempotency_key="k1"),
            EnqueueRequest(name="t", payload=2, idempotency_key="k2", delay=5.0),
        )[1],
    ),
}


@pytest.fixture
def engines(pgtask_database_url: str) -> Iterator[tuple[Engine, Engine]]:
    """(compiled, driver): a ``before_execute`` listener keeps the first on the compiled path."""
    compiled = create_engine(pgtask_database_url)
    event.listen(compiled, "before_execute", lambda *args: None)
    driver = create_engine(pgtask_database_url)
    try:
        yield compiled, driver
    finally:
        compiled.dispose()
        driver.dispose()


def _sent(engine: Engine, statement: Executable, params: Any) -> tuple[str, Any, bool]:
    """What ``execute`` handed the cursor: the SQL, the parameters, whether it was compiled."""
    seen: list[tuple[str, Any, bool]] = []

    def record(conn: Any, cursor: Any, sql: str, sent: Any, context: Any, many: bool) -> None:
        seen.append((sql, dict(sent), context.compiled is not None))

    event.listen(engine, "before_cursor_execute", record)
    with engine.connect() as connection:
        execute(connection, statement, params)
        connection.rollback()
    return seen[0]


def _typed(params: dict[str, Any]) -> dict[str, Any]:
    return {
        key: [(type(item), item) for item in value] if isinstance(value, list)
        else (type(value), value)
        for key, value in params.items()
    }


@pytest.mark.parametrize("name", list(CASES))
def test_the_driver_text_sends_what_the_compiled_path_sends(
    engines: tuple[Engine, Engine], name: str
) -> None:
    compiled_engine, driver_engine = engines
    statement, params = CASES[name]
    with driver_engine.connect() as connection:
        assert driver_statement(connection, statement) is not None, name
    compiled_sql, compiled_params, was_compiled = _sent(compiled_engine, statement, params)
    driver_sql, driver_params, driver_compiled = _sent(driver_engine, statement, params)
    assert (was_compiled, driver_compiled) == (True, False)
    # The compiled path compiles with the parameters' keys as column keys: same text, but for
    # the placeholders of the arrays sent in binary.
    assert driver_sql == re.sub(r"%\((\w+)\)s(::(?:UUID|INTEGER|SMALLINT|DOUBLE PRECISION|TEXT|"
                                r"BOOLEAN)\[\])", r"%(\1)b\2", compiled_sql)
    assert _typed(driver_params) == _typed(compiled_params)


#: The cases with array parameters: all but the single enqueues.
ARRAY_CASES = [name for name in CASES if name not in ("ENQUEUE_PLAIN", "ENQUEUE_ONE")]


@pytest.mark.parametrize("name", ARRAY_CASES)
def test_arrays_sent_in_binary_reach_the_server_as_the_same_values(
    engines: tuple[Engine, Engine], name: str
) -> None:
    _, driver_engine = engines
    statement, params = CASES[name]
    with driver_engine.connect() as connection:
        prepared = driver_statement(connection, statement)
        assert prepared is not None
        binary = dict(re.findall(r"%\((\w+)\)b::([A-Z ]+\[\])", prepared.sql))
        for key, cast in binary.items():
            value = prepared.parameters(params)[key]
            as_text, as_binary, same = connection.exec_driver_sql(
                f"SELECT %(t)s::{cast}::text, %(b)b::{cast}::text,"
                f" %(t)s::{cast} IS NOT DISTINCT FROM %(b)b::{cast}",
                {"t": value, "b": value},
            ).one()
            assert (key, as_binary, same) == (key, as_text, True)
    assert binary
    # Not every array goes in binary: timestamps keep the text form.
    if name == "ENQUEUE_BATCH":
        assert "%(run_ats)s::TIMESTAMP WITH TIME ZONE[]" in prepared.sql


def test_array_parameters_given_as_tuples_reach_the_driver_as_lists(
    engines: tuple[Engine, Engine],
) -> None:
    compiled_engine, driver_engine = engines
    statement, params = CASES["COMPLETE"]
    as_tuples = {key: tuple(value) for key, value in params.items()}
    _, compiled_params, _ = _sent(compiled_engine, statement, as_tuples)
    _, driver_params, _ = _sent(driver_engine, statement, as_tuples)
    assert _typed(driver_params) == _typed(compiled_params)
    assert [type(driver_params[key]) for key in params] == [list] * len(params)
