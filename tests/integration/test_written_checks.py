"""The checks on a task's names and JSON hold for every writer, and run only when written.

Revision ``pgtask_0008`` turned six CHECK constraints of ``pgtask.tasks`` into row triggers with
the same conditions, fired by an ``INSERT`` (``COPY`` included) or an ``UPDATE`` that sets their
column: a claim or a completion no longer re-prints the payload. Revision ``pgtask_0012``
checks an insert's rows once per statement instead (one trigger reading its transition table),
naming what the row triggers named. A writer that bypasses the
library still cannot store a bad row, and the error is the one the CHECK gave (SQLSTATE 23514,
naming the constraint). The limits are the library's own (`sqlalchemy_pgtask.validation`): a
value at the limit is stored, one byte over is refused.
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from sqlalchemy_pgtask.validation import (
    ERROR_MAX_BYTES,
    HEADERS_MAX_BYTES,
    PAYLOAD_MAX_BYTES,
    QUEUE_NAME_MAX_BYTES,
    RESULT_MAX_BYTES,
    TASK_NAME_MAX_BYTES,
)
from tests.support.urls import libpq_url

_JSON = frozenset({"payload", "headers", "result", "error"})


def _string(size: int) -> str:
    """A JSON string whose ``jsonb`` text is ``size`` bytes (its quotes included)."""
    return '"' + "x" * (size - 2) + '"'


def _object(size: int) -> str:
    """A JSON object whose ``jsonb`` text is ``size`` bytes."""
    return '{"k": "' + "x" * (size - len('{"k": ""}')) + '"}'


class Case(NamedTuple):
    constraint: str
    column: str
    at_limit: str
    bad: str


CASES = [
    Case("ck_tasks_name", "name", "n" * TASK_NAME_MAX_BYTES, "n" * (TASK_NAME_MAX_BYTES + 1)),
    Case("ck_tasks_name", "name", "a.b_c:d-9", "no spaces"),
    Case("ck_tasks_queue", "queue", "q" * QUEUE_NAME_MAX_BYTES, "q" * (QUEUE_NAME_MAX_BYTES + 1)),
    Case("ck_tasks_queue", "queue", "a.b_c:d-9", "trailing\n"),
    Case("ck_tasks_payload_size", "payload", _string(PAYLOAD_MAX_BYTES),
         _string(PAYLOAD_MAX_BYTES + 1)),
    Case("ck_tasks_headers", "headers", _object(HEADERS_MAX_BYTES), _object(HEADERS_MAX_BYTES + 1)),
    Case("ck_tasks_headers", "headers", "{}", "[]"),
    Case("ck_tasks_result_size", "result", _string(RESULT_MAX_BYTES),
         _string(RESULT_MAX_BYTES + 1)),
    Case("ck_tasks_error_size", "error", _string(ERROR_MAX_BYTES), _string(ERROR_MAX_BYTES + 1)),
]
IDS = [f"{case.column}-{i}" for i, case in enumerate(CASES)]


def _value(column: str) -> str:
    return "CAST(:value AS jsonb)" if column in _JSON else ":value"


def _insert(engine: Engine, column: str, value: str) -> uuid.UUID:
    task_id = uuid.uuid4()
    defaults = {"queue": "'default'", "name": "'t'", "payload": "'{}'"}
    defaults[column] = _value(column)
    columns = ", ".join(defaults)
    with engine.begin() as connection:
        values = ", ".join(defaults.values())
        connection.execute(
            text(f"INSERT INTO pgtask.tasks (id, {columns}) VALUES (:id, {values})"),
            {"id": task_id, "value": value},
        )
    return task_id


def _stored(engine: Engine, column: str, task_id: uuid.UUID) -> str:
    cast = "::text" if column in _JSON else ""
    with engine.connect() as connection:
        return str(connection.execute(
            text(f"SELECT {column}{cast} FROM pgtask.tasks WHERE id = :id"), {"id": task_id}
        ).scalar_one())


def _count(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT count(*) FROM pgtask.tasks")).scalar_one())


def _refused(error: IntegrityError, constraint: str) -> None:
    driver = error.orig
    assert isinstance(driver, psycopg.errors.CheckViolation), type(driver)
    assert driver.sqlstate == "23514"
    assert driver.diag.constraint_name == constraint
    assert f'violates check constraint "{constraint}"' in str(driver)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_value_at_the_limit_is_stored(pgtask_engine: Engine, case: Case) -> None:
    task_id = _insert(pgtask_engine, case.column, case.at_limit)

    assert _stored(pgtask_engine, case.column, task_id) == case.at_limit


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_insert_with_a_bad_value_is_refused_naming_the_constraint(
    pgtask_engine: Engine, case: Case
) -> None:
    with pytest.raises(IntegrityError) as refused:
        _insert(pgtask_engine, case.column, case.bad)

    _refused(refused.value, case.constraint)
    assert _count(pgtask_engine) == 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_update_setting_a_bad_value_is_refused_and_changes_nothing(
    pgtask_engine: Engine, case: Case
) -> None:
    task_id = _insert(pgtask_engine, case.column, case.at_limit)
    update = text(f"UPDATE pgtask.tasks SET {case.column} = {_value(case.column)} WHERE id = :id")

    with pytest.raises(IntegrityError) as refused, pgtask_engine.begin() as connection:
        connection.execute(update, {"id": task_id, "value": case.bad})

    _refused(refused.value, case.constraint)
    assert _stored(pgtask_engine, case.column, task_id) == case.at_limit


def test_a_statement_is_refused_for_its_first_bad_row_naming_what_a_row_trigger_named(
    pgtask_engine: Engine,
) -> None:
    # Rows 2 and 3 are bad; row 2 breaks two checks, and the row triggers fired by name, so
    # the error named its first in that order (the name before the payload's size).
    ids = [uuid.uuid4() for _ in range(4)]
    big = _string(PAYLOAD_MAX_BYTES + 1)
    with pytest.raises(IntegrityError) as refused, pgtask_engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO pgtask.tasks (id, queue, name, payload) VALUES"
                " (:a, 'default', 't', '{}'), (:b, 'default', 'bad name', CAST(:big AS jsonb)),"
                " (:c, 'bad queue', 't', '{}'), (:d, 'default', 't', '{}')"
            ),
            {"a": ids[0], "b": ids[1], "c": ids[2], "d": ids[3], "big": big},
        )

    _refused(refused.value, "ck_tasks_name")
    assert isinstance(refused.value.orig, psycopg.Error)
    assert refused.value.orig.diag.message_detail == f"Failing row has id {ids[1]}."
    assert _count(pgtask_engine) == 0


def test_an_insert_is_checked_once_per_statement_and_an_update_per_row(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.connect() as connection:
        triggers: dict[str, int] = dict(connection.execute(text(
            "SELECT tgname, tgtype FROM pg_trigger WHERE tgrelid = 'pgtask.tasks'::regclass"
            " AND tgname LIKE 'tasks_check_%'"
        )).all())
    row, insert, update = 1, 4, 16  # pg_trigger.tgtype bits
    assert triggers.pop("tasks_check_inserted") & (row | insert | update) == insert
    assert triggers, "the column checks on UPDATE are still there"
    assert {name: kind & (row | insert | update) for name, kind in triggers.items()} == {
        name: row | update for name in triggers
    }


def test_a_copy_with_one_bad_row_is_refused_whole(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    rows = [(uuid.uuid4(), "default", "t", "{}") for _ in range(50)]
    rows.insert(25, (uuid.uuid4(), "default", "bad name", "{}"))

    def copy_all(connection: psycopg.Connection[tuple[object, ...]]) -> None:
        with connection.cursor() as cursor, cursor.copy(
            "COPY pgtask.tasks (id, queue, name, payload) FROM STDIN"
        ) as copy:
            for row in rows:
                copy.write_row(row)

    with psycopg.connect(libpq_url(pgtask_database_url)) as connection:
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            copy_all(connection)
        connection.rollback()

    assert refused.value.diag.constraint_name == "ck_tasks_name"
    assert _count(pgtask_engine) == 0


def test_each_check_fires_only_when_its_own_column_is_written(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as connection:
        triggers: dict[str, list[str]] = dict(
            connection.execute(
                text(
                    "SELECT t.tgname, array_agg(a.attname::text ORDER BY a.attname)"
                    " FROM pg_trigger AS t"
                    " JOIN pg_attribute AS a"
                    "   ON a.attrelid = t.tgrelid AND a.attnum = ANY (t.tgattr::int2[])"
                    " WHERE t.tgrelid = 'pgtask.tasks'::regclass AND t.tgname LIKE 'tasks_check_%'"
                    " GROUP BY t.tgname"
                )
            ).all()
        )
        # What is left as CHECK constraints (evaluated on every UPDATE of a row) reads neither
        # a pattern nor a jsonb's text: the one length check left is the concurrency key's,
        # NULL for unkeyed tasks and at most 512 bytes of plain text, never detoasted.
        checks = connection.execute(
            text(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE conrelid = 'pgtask.tasks'::regclass AND contype = 'c'"
            )
        ).scalars().all()

    assert triggers == {
        "tasks_check_name": ["name"],
        "tasks_check_queue": ["queue"],
        "tasks_check_payload_size": ["payload"],
        "tasks_check_headers": ["headers"],
        "tasks_check_result_size": ["result"],
        "tasks_check_error_size": ["error"],
    }
    assert checks, "the other CHECK constraints are still there"
    costly = [c for c in checks if " ~ " in c or "octet_length" in c or "jsonb" in c]
    assert costly == [
        "CHECK (((concurrency_key IS NULL) OR ((octet_length(concurrency_key) >= 1)"
        " AND (octet_length(concurrency_key) <= 512))))"
    ]


def _has_lz4(database_url: str) -> bool:
    """Whether the server was built with lz4 (PostgreSQL refuses the method otherwise)."""
    with psycopg.connect(libpq_url(database_url)) as connection:
        try:
            connection.execute("CREATE TEMPORARY TABLE lz4_probe (v text COMPRESSION lz4)")
        except psycopg.errors.FeatureNotSupported:
            return False
        finally:
            connection.rollback()
        return True


def test_payloads_and_results_are_compressed_with_lz4_where_the_server_has_it(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    expected = "lz4" if _has_lz4(pgtask_database_url) else "pglz"
    compressible = '{"text": "' + "abc " * 5_000 + '"}'
    task_id = _insert(pgtask_engine, "payload", compressible)
    with pgtask_engine.begin() as connection:
        connection.execute(
            text("UPDATE pgtask.tasks SET result = CAST(:value AS jsonb) WHERE id = :id"),
            {"id": task_id, "value": compressible},
        )
        payload, result = connection.execute(
            text(
                "SELECT pg_column_compression(payload), pg_column_compression(result)"
                " FROM pgtask.tasks WHERE id = :id"
            ),
            {"id": task_id},
        ).one()

    assert (payload, result) == (expected, expected)
