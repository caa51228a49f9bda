"""How a worker decodes the JSON it claims: as ``json.loads`` would, unless the application's
own engine says otherwise.

A worker given a URL decodes payloads with its own decoder (`load_json`, cheaper than
``json.loads`` on bytes), and the claim returns NULL for the usual empty headers; a worker
given the application's engine keeps that engine's ``json_deserializer``.
"""

from __future__ import annotations

import functools
import json
import uuid
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions, enqueue, statements
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import add, claim_parameters, wait_for_state

FAST = WorkerOptions(lease_duration=1.5, heartbeat_interval=0.5, worker_ttl=2.0)

PAYLOADS: list[Any] = [
    {"i": 1, "nested": {"list": [1, 2.5, None, True, False]}},
    {"text": "naïve café ☕ 𝄞 日本語", "escaped": "line\nbreak \"quoted\" \\ \t"},
    {"big": 12345678901234567890123, "small": -0.0, "exp": 1.5e-7, "huge": 1e300},
    [],
    "just a string",
    42,
    None,
]


def test_the_claim_returns_null_for_empty_headers_and_the_headers_otherwise(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as conn:
        plain = enqueue(conn, "job").id
        given_empty = enqueue(conn, "job", headers={}).id
        traced = enqueue(conn, "job", headers={"trace": "t-1"}).id
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        rows = conn.execute(
            statements.CLAIM, claim_parameters(worker_id=uuid.uuid4(), lease=30.0)
        ).all()
    assert {row.id: row.headers for row in rows} == {
        plain: None, given_empty: None, traced: {"trace": "t-1"}
    }


Seen = dict[uuid.UUID, tuple[Any, dict[str, str]]]


def _echo_registry(seen: Seen) -> Registry:
    registry = Registry()

    @registry.task("echo")
    async def echo(ctx: TaskContext, payload: Any) -> None:
        seen[ctx.task_id] = (payload, ctx.headers)

    return registry


async def test_a_worker_given_a_url_decodes_payloads_and_headers_as_json_loads_would(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    seen: Seen = {}
    ids = [await add(pgtask_async_engine, "echo", payload) for payload in PAYLOADS]
    ids.append(await add(pgtask_async_engine, "echo", {"h": 1}, headers={"trace": "t-ü"}))
    async with running_worker(_echo_registry(seen), pgtask_database_url, FAST):
        for task_id in ids:
            assert (await wait_for_state(pgtask_async_engine, task_id))["state"] == "succeeded"

    with pgtask_engine.connect() as conn:
        stored = {
            row.id: (json.loads(row.payload), json.loads(row.headers))
            for row in conn.execute(
                text("SELECT id, payload::text, headers::text FROM pgtask.tasks")
            )
        }
    assert seen == stored
    for payload, headers in seen.values():
        assert type(headers) is dict  # no headers: an empty dict, not None
        if isinstance(payload, dict) and "big" in payload:
            assert type(payload["big"]) is int
            assert type(payload["exp"]) is float


async def test_a_worker_given_an_engine_keeps_its_json_deserializer(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    engine = create_async_engine(
        make_url(pgtask_database_url).set(drivername="postgresql+psycopg"),
        json_deserializer=functools.partial(json.loads, parse_float=Decimal),
    )
    seen: Seen = {}
    try:
        task_id = await add(pgtask_async_engine, "echo", {"price": 19.99})
        async with running_worker(_echo_registry(seen), engine, FAST):
            assert (await wait_for_state(pgtask_async_engine, task_id))["state"] == "succeeded"
    finally:
        await engine.dispose()
    assert seen == {task_id: ({"price": Decimal("19.99")}, {})}
