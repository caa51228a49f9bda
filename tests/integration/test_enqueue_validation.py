"""Bad input gets a typed error before any SQL runs, and the caller's transaction stays usable."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.types import Text

from sqlalchemy_pgtask import (
    EnqueueRequest,
    IdempotencyKey,
    InvalidNameError,
    InvalidOptionError,
    PayloadError,
    Task,
    ValidationError,
    enqueue,
    enqueue_async,
    enqueue_many,
)
from sqlalchemy_pgtask.validation import HEADERS_MAX_BYTES, PAYLOAD_MAX_BYTES, jsonb_text_size

AWARE = datetime(2030, 1, 1, tzinfo=timezone.utc)

# (keyword arguments for enqueue, expected error type, the field it names)
BAD_INPUT: list[Any] = [
    pytest.param({"name": ""}, InvalidNameError, "name", id="empty-name"),
    pytest.param({"name": "has space"}, InvalidNameError, "name", id="name-charset"),
    pytest.param({"name": "n" * 256}, InvalidNameError, "name", id="name-too-long"),
    pytest.param({"queue": "bad/queue"}, InvalidNameError, "queue", id="queue-charset"),
    pytest.param({"queue": "q" * 129}, InvalidNameError, "queue", id="queue-too-long"),
    pytest.param({"payload": {"when": datetime.now()}}, PayloadError, "payload", id="not-json"),
    pytest.param({"payload": float("nan")}, PayloadError, "payload", id="nan"),
    pytest.param({"payload": "x" * (1024 * 1024)}, PayloadError, "payload", id="payload-over-1mib"),
    pytest.param({"payload": {"a": "b\x00"}}, PayloadError, "payload", id="payload-nul"),
    pytest.param({"headers": ["a"]}, PayloadError, "headers", id="headers-not-object"),
    pytest.param({"headers": {"k": "\x00"}}, PayloadError, "headers", id="headers-nul"),
    pytest.param({"headers": {"k": "v" * 70_000}}, PayloadError, "headers", id="headers-64kib"),
    pytest.param({"max_attempts": 0}, InvalidOptionError, "max_attempts", id="max-attempts-zero"),
    pytest.param({"version": 0}, InvalidOptionError, "version", id="version-zero"),
    pytest.param({"version": 2**31}, InvalidOptionError, "version", id="version-overflow"),
    pytest.param({"priority": 40_000}, InvalidOptionError, "priority", id="priority-overflow"),
    pytest.param({"delay": -1}, InvalidOptionError, "delay", id="negative-delay"),
    pytest.param({"delay": timedelta(seconds=-1)}, InvalidOptionError, "delay", id="negative-td"),
    pytest.param({"delay": 5, "run_at": AWARE}, InvalidOptionError, "run_at", id="both"),
    pytest.param({"run_at": datetime(2030, 1, 1)}, InvalidOptionError, "run_at", id="naive"),
    pytest.param({"idempotency_key": ""}, InvalidNameError, "idempotency_key", id="empty-key"),
    pytest.param({"idempotency_key": "k\x00"}, InvalidNameError, "idempotency_key", id="key-nul"),
]


def _call(kwargs: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    options = dict(kwargs)
    name = options.pop("name", "valid-name")
    payload = options.pop("payload", {"ok": True})
    return name, payload, options


def _count(session: Session) -> tuple[int, int]:
    tasks = session.scalar(select(func.count()).select_from(Task))
    keys = session.scalar(select(func.count()).select_from(IdempotencyKey))
    return int(tasks or 0), int(keys or 0)


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_INPUT)
def test_enqueue_rejects_bad_input_before_any_sql(
    pgtask_engine: Engine, kwargs: dict[str, Any], error: type[ValidationError], field: str
) -> None:
    executed: list[str] = []
    event.listen(pgtask_engine, "before_cursor_execute", lambda *a: executed.append(a[2]))
    name, payload, options = _call(kwargs)
    with Session(pgtask_engine) as session:
        with pytest.raises(error) as caught:
            enqueue(session, name, payload, **options)
        assert executed == []
        assert caught.value.field == field
        assert isinstance(caught.value, ValueError)
        # The transaction is still usable: more work and a commit go through.
        enqueue(session, "after-the-error")
        session.commit()
        assert _count(session) == (1, 0)


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_INPUT)
def test_enqueue_many_rejects_a_batch_with_one_bad_request(
    pgtask_engine: Engine, kwargs: dict[str, Any], error: type[ValidationError], field: str
) -> None:
    name, payload, options = _call(kwargs)
    batch = [
        EnqueueRequest(name="good", idempotency_key="g"),
        EnqueueRequest(name=name, payload=payload, **options),
    ]
    with Session(pgtask_engine) as session:
        with pytest.raises(error) as caught:
            enqueue_many(session, batch)
        assert caught.value.field == f"[1].{field}"
        session.commit()
        assert _count(session) == (0, 0)


def test_enqueue_many_rejects_items_that_are_not_requests(pgtask_engine: Engine) -> None:
    with (
        Session(pgtask_engine) as session,
        pytest.raises(InvalidOptionError, match=r"\[0\]: must be an EnqueueRequest"),
    ):
        enqueue_many(session, [{"name": "t"}])  # type: ignore[list-item]


async def test_async_enqueue_rejects_bad_input_before_any_sql(
    pgtask_async_engine: AsyncEngine,
) -> None:
    async with AsyncSession(pgtask_async_engine) as session:
        with pytest.raises(PayloadError):
            await enqueue_async(session, "t", {1, 2})
        assert not session.in_transaction()


# -- sizes: what Python accepts, the CHECK accepts -----------------------------------------


def test_python_counts_json_sizes_exactly_as_postgres_jsonb_text_measures_them(
    pgtask_engine: Engine,
) -> None:
    rng = random.Random(6)
    values: list[Any] = [
        1e300, -1e-300, 5e-324, 1.7976931348623157e308, 1.5e-07, 1e16, 123.25, 0.0,
        "1e+300", {"k\"1e+5": [2.5e-9, "e-5", {"deep": -3e+40}]}, ["\\", 1e22, "é"],
    ]
    values += [rng.choice((-1, 1)) * rng.random() * 10.0 ** rng.randint(-320, 307)
               for _ in range(300)]
    values = [value or 0.0 for value in values]  # jsonb drops the sign of -0.0
    texts = [json.dumps(value, ensure_ascii=False) for value in values]
    with pgtask_engine.connect() as connection:
        measured = connection.execute(
            text("SELECT octet_length(t::jsonb::text) FROM unnest(CAST(:texts AS text[])) t"),
            {"texts": texts},
        ).scalars().all()
    assert [jsonb_text_size(t) for t in texts] == measured


@pytest.mark.parametrize(
    ("number", "where"),
    [(1e300, "payload"), (-1e-300, "payload"), (1e300, "headers")],
    ids=["payload-1e300", "payload-minus-1e-300", "headers-1e300"],
)
def test_a_value_at_the_jsonb_limit_is_stored_and_one_byte_more_is_refused_before_sql(
    pgtask_engine: Engine, number: float, where: str
) -> None:
    limit = PAYLOAD_MAX_BYTES if where == "payload" else HEADERS_MAX_BYTES

    def value(padding: int) -> dict[str, Any]:
        return {"pad": "x" * padding, "n": number}

    # jsonb writes the number out as numeric does, which is Decimal's "f" format.
    bare = len(json.dumps(value(0))) - len(repr(number)) + len(format(Decimal(repr(number)), "f"))
    at_limit: dict[str, Any] = {where: value(limit - bare)}
    over: dict[str, Any] = {where: value(limit - bare + 1)}
    with Session(pgtask_engine) as session:
        task_id = enqueue(session, "t", **at_limit).id  # the CHECK accepts it
        with pytest.raises(PayloadError) as caught:
            enqueue(session, "t", **over)
        assert caught.value.field == where
        session.commit()
        column = Task.payload if where == "payload" else Task.headers
        stored = session.scalar(
            select(func.octet_length(func.cast(column, Text))).where(Task.id == task_id)
        )
    assert stored == limit
