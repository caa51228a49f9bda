"""The bad-input battery: every case is a typed `ValidationError`, raised before any SQL.

Each case used to reach PostgreSQL (aborting the caller's transaction) or to be accepted and
break later: in the worker, in a trigger, or when the task was read back. Every case here runs
inside a transaction that has already written something; after the error, the same
transaction enqueues again and commits, which proves nothing reached the database.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    InvalidNameError,
    InvalidOptionError,
    PayloadError,
    Registry,
    Retry,
    RetryPolicy,
    SyncTaskContext,
    Task,
    ValidationError,
    configure_queue,
    enqueue,
    enqueue_many,
    wait_for_result,
    wait_for_result_async,
)
from sqlalchemy_pgtask.validation import (
    DURATION_MAX_SECONDS,
    HEADERS_MAX_BYTES,
    PAYLOAD_MAX_BYTES,
)

# Nothing listens there: a waiter that connected before checking its arguments would fail
# with a connection error instead of the validation error.
UNREACHABLE = "postgresql+psycopg://nobody@127.0.0.1:9/nowhere"


def over_only_as_jsonb(number: float, limit: int, wrap: Callable[[str], Any]) -> Any:
    """``wrap(padding)`` whose JSON text fits ``limit`` but whose jsonb text is 1 byte over.

    jsonb prints numbers as ``numeric`` does, never in exponent form: its text for ``number``
    is what `Decimal` formats with ``"f"``.
    """
    expansion = len(format(Decimal(repr(number)), "f")) - len(repr(number))
    bare = len(json.dumps(wrap(""), ensure_ascii=False).encode())
    value = wrap("x" * (limit + 1 - bare - expansion))
    assert len(json.dumps(value, ensure_ascii=False).encode()) <= limit  # the text fits
    return value


def handler(ctx: SyncTaskContext, payload: Any) -> None:
    """A handler to register."""


def wait(**options: Any) -> object:
    return wait_for_result(create_engine(UNREACHABLE), uuid.uuid4(), **options)


def wait_async(**options: Any) -> object:
    async def run() -> object:
        engine = create_async_engine(UNREACHABLE)
        try:
            return await wait_for_result_async(engine, uuid.uuid4(), **options)
        finally:
            await engine.dispose()

    return asyncio.run(run())


PLUS_5 = timezone(timedelta(hours=5))
MINUS_5 = timezone(timedelta(hours=-5))

# (a call that gets the open session, the error type, the field the error names)
BATTERY: list[Any] = [
    # Names: Python's ``$`` matches before a final newline; the database's does not.
    pytest.param(lambda s: enqueue(s, "send\n"), InvalidNameError, "name",
                 id="task-name-trailing-newline"),
    pytest.param(lambda s: enqueue(s, "t", queue="emails\n"), InvalidNameError, "queue",
                 id="queue-trailing-newline"),
    pytest.param(lambda s: Registry().task("send\n")(handler), InvalidNameError, "name",
                 id="registered-name-trailing-newline"),
    # Sizes as jsonb measures them: floats in exponent form are written out in full.
    pytest.param(lambda s: enqueue(s, "t", over_only_as_jsonb(
        1e300, PAYLOAD_MAX_BYTES, lambda pad: [pad, 1e300])), PayloadError, "payload",
        id="payload-1e300-over-as-jsonb"),
    pytest.param(lambda s: enqueue(s, "t", over_only_as_jsonb(
        -1e-300, PAYLOAD_MAX_BYTES, lambda pad: {"pad": pad, "n": -1e-300})),
        PayloadError, "payload", id="payload-minus-1e-300-over-as-jsonb"),
    pytest.param(lambda s: enqueue(s, "t", headers=over_only_as_jsonb(
        1e300, HEADERS_MAX_BYTES, lambda pad: {"pad": pad, "n": 1e300})),
        PayloadError, "headers", id="headers-1e300-over-as-jsonb"),
    pytest.param(lambda s: enqueue_many(s, [EnqueueRequest(name="t", payload=over_only_as_jsonb(
        1e300, PAYLOAD_MAX_BYTES, lambda pad: [pad, 1e300]))]), PayloadError, "[0].payload",
        id="batch-payload-1e300-over-as-jsonb"),
    # Times PostgreSQL would store but Python could never read back.
    pytest.param(lambda s: enqueue(s, "t", run_at=datetime(1, 1, 1, tzinfo=PLUS_5)),
                 InvalidOptionError, "run_at", id="run-at-year-0-in-utc"),
    pytest.param(lambda s: enqueue(s, "t", run_at=datetime(9999, 12, 31, 23, tzinfo=MINUS_5)),
                 InvalidOptionError, "run_at", id="run-at-year-10000-in-utc"),
    # Durations beyond DURATION_MAX_SECONDS (100 years) overflow an interval or a timestamp.
    pytest.param(lambda s: enqueue(s, "t", delay=timedelta.max), InvalidOptionError, "delay",
                 id="delay-timedelta-max"),
    pytest.param(lambda s: enqueue(s, "t", delay=1e300), InvalidOptionError, "delay",
                 id="delay-1e300"),
    pytest.param(lambda s: enqueue(s, "t", delay=DURATION_MAX_SECONDS + 1), InvalidOptionError,
                 "delay", id="delay-just-over-100-years"),
    pytest.param(lambda s: enqueue(s, "t", delay=10**400), InvalidOptionError, "delay",
                 id="delay-int-beyond-float"),
    pytest.param(lambda s: enqueue_many(s, [EnqueueRequest(name="t", delay=1e300)]),
                 InvalidOptionError, "[0].delay", id="batch-delay-1e300"),
    pytest.param(lambda s: RetryPolicy.fixed(1e300), InvalidOptionError, "retry.delay",
                 id="retry-fixed-1e300"),
    pytest.param(lambda s: RetryPolicy.exponential(max=1e300), InvalidOptionError, "retry.max",
                 id="retry-huge-max"),
    pytest.param(lambda s: RetryPolicy.exponential(base=1e300, max=1e300), InvalidOptionError,
                 "retry.base", id="retry-huge-base"),
    pytest.param(lambda s: RetryPolicy.fixed(1.0, jitter="no"),  # type: ignore[arg-type]
                 InvalidOptionError, "retry.jitter", id="retry-jitter-not-bool"),
    pytest.param(lambda s: Retry(delay=1e300), InvalidOptionError, "delay",
                 id="handler-retry-delay-1e300"),
    pytest.param(lambda s: configure_queue(s, "q", idempotency_retention_seconds=2**63 - 1),
                 InvalidOptionError, "idempotency_retention_seconds",
                 id="idempotency-retention-int8-max"),
    pytest.param(lambda s: configure_queue(
        s, "q", terminal_retention_seconds=DURATION_MAX_SECONDS + 1), InvalidOptionError,
        "terminal_retention_seconds", id="terminal-retention-over-100-years"),
    # Keys must be sendable as UTF-8.
    pytest.param(lambda s: enqueue(s, "t", idempotency_key="\ud800"), InvalidNameError,
                 "idempotency_key", id="key-lone-high-surrogate"),
    pytest.param(lambda s: enqueue(s, "t", idempotency_key="order-\udfff"), InvalidNameError,
                 "idempotency_key", id="key-lone-low-surrogate"),
    # Registration: a bare class instead of a tuple.
    pytest.param(lambda s: Registry().task(
        "t", non_retryable=ValueError)(handler),  # type: ignore[arg-type]
        InvalidOptionError, "non_retryable", id="non-retryable-bare-class"),
    # Waiters check their arguments before connecting.
    pytest.param(lambda s: wait(timeout=math.nan), InvalidOptionError, "timeout",
                 id="wait-timeout-nan"),
    pytest.param(lambda s: wait(timeout="5"), InvalidOptionError, "timeout",
                 id="wait-timeout-str"),
    pytest.param(lambda s: wait(timeout=-1), InvalidOptionError, "timeout",
                 id="wait-timeout-negative"),
    pytest.param(lambda s: wait(poll_interval=0), InvalidOptionError, "poll_interval",
                 id="wait-poll-zero"),
    pytest.param(lambda s: wait(poll_interval=-0.5), InvalidOptionError, "poll_interval",
                 id="wait-poll-negative"),
    pytest.param(lambda s: wait(poll_interval="1"), InvalidOptionError, "poll_interval",
                 id="wait-poll-str"),
    pytest.param(lambda s: wait(poll_interval=math.nan), InvalidOptionError, "poll_interval",
                 id="wait-poll-nan"),
    pytest.param(lambda s: wait_async(timeout=math.nan), InvalidOptionError, "timeout",
                 id="wait-async-timeout-nan"),
    pytest.param(lambda s: wait_async(timeout=-1), InvalidOptionError, "timeout",
                 id="wait-async-timeout-negative"),
    pytest.param(lambda s: wait_async(poll_interval=0), InvalidOptionError, "poll_interval",
                 id="wait-async-poll-zero"),
]


@pytest.mark.parametrize(("call", "error", "field"), BATTERY)
def test_bad_input_is_a_typed_error_before_any_sql_and_the_transaction_stays_usable(
    pgtask_engine: Engine,
    call: Callable[[Session], object],
    error: type[ValidationError],
    field: str,
) -> None:
    executed: list[str] = []
    event.listen(pgtask_engine, "before_cursor_execute", lambda *a: executed.append(a[2]))
    with Session(pgtask_engine) as session:
        enqueue(session, "before")  # the caller's transaction is under way
        executed.clear()
        with pytest.raises(error) as caught:
            call(session)
        assert caught.value.field == field
        assert executed == []
        enqueue(session, "after")
        session.commit()
        assert sorted(session.scalars(select(Task.name))) == ["after", "before"]
