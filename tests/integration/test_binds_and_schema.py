"""Every client function checks its bind before any SQL, and names a missing schema.

A synchronous function given an async session would return an un-awaited coroutine and write
nothing; an async function given a ``Session`` used to run its INSERT and then fail; an engine
has no transaction to join. Each is a `TypeError` naming what to pass instead, raised before
any SQL, and the caller's transaction stays usable. Scoped sessions stand for their current
session, without flushing it.

Against a database without the pgtask schema, every client function raises
`SchemaNotInstalled` (saying how to install it) from the driver's error, instead of a raw
``ProgrammingError``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.exc import DBAPIError, ProgrammingError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from sqlalchemy_pgtask import (
    EnqueueRequest,
    Queue,
    SchemaNotInstalled,
    Task,
    cancel,
    cancel_async,
    configure_queue,
    configure_queue_async,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
    get_task,
    get_task_async,
    list_queues,
    list_queues_async,
    wait_for_result,
    wait_for_result_async,
)
from sqlalchemy_pgtask._connection import translated_errors
from sqlalchemy_pgtask.worker import NETWORK_DEFAULTS
from sqlalchemy_pgtask.worker._reconnect import owned_engine
from tests.support.engines import statements_of

SyncCall = Callable[[Any], object]
AsyncCall = Callable[[Any], Awaitable[object]]

# (the function's name in messages, a call of it with a bind)
SYNC_CALLS: list[Any] = [
    pytest.param("enqueue", lambda b: enqueue(b, "t"), id="enqueue"),
    pytest.param("enqueue_many", lambda b: enqueue_many(b, [EnqueueRequest(name="t")]),
                 id="enqueue_many"),
    pytest.param("enqueue_many", lambda b: enqueue_many(b, []), id="enqueue_many-empty"),
    pytest.param("cancel", lambda b: cancel(b, uuid.uuid4()), id="cancel"),
    pytest.param("get_task", lambda b: get_task(b, uuid.uuid4()), id="get_task"),
    pytest.param("configure_queue", lambda b: configure_queue(b, "q"), id="configure_queue"),
    pytest.param("list_queues", list_queues, id="list_queues"),
]
ASYNC_CALLS: list[Any] = [
    pytest.param("enqueue", lambda b: enqueue_async(b, "t"), id="enqueue_async"),
    pytest.param("enqueue_many", lambda b: enqueue_many_async(b, [EnqueueRequest(name="t")]),
                 id="enqueue_many_async"),
    pytest.param("cancel", lambda b: cancel_async(b, uuid.uuid4()), id="cancel_async"),
    pytest.param("get_task", lambda b: get_task_async(b, uuid.uuid4()), id="get_task_async"),
    pytest.param("configure_queue", lambda b: configure_queue_async(b, "q"),
                 id="configure_queue_async"),
    pytest.param("list_queues", list_queues_async, id="list_queues_async"),
]


def task_names(engine: Engine) -> list[str]:
    with engine.connect() as connection:
        return sorted(connection.execute(select(Task.name)).scalars())


@contextmanager
def sync_bind(engine: Engine, kind: str) -> Iterator[Session | Connection]:
    if kind == "Session":
        with Session(engine) as session:
            yield session
    else:
        with engine.connect() as connection:
            yield connection


@asynccontextmanager
async def async_bind(
    engine: AsyncEngine, kind: str
) -> AsyncIterator[AsyncSession | AsyncConnection]:
    if kind == "AsyncSession":
        async with AsyncSession(engine) as session:
            yield session
    else:
        async with engine.connect() as connection:
            yield connection


# -- the wrong kind of bind ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "call"), SYNC_CALLS)
@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
async def test_a_sync_function_given_an_async_bind_raises_type_error_before_any_sql(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, name: str, call: SyncCall,
    kind: str,
) -> None:
    seen = statements_of(pgtask_async_engine.sync_engine)
    async with async_bind(pgtask_async_engine, kind) as bind:
        with pytest.raises(TypeError, match=rf"^{name}\(\) needs .*; for an {kind} use "
                                            rf"{name}_async\(\)$"):
            call(bind)
        assert seen == []
        await enqueue_async(bind, "after")  # the caller's transaction is still usable
        await bind.commit()
    assert task_names(pgtask_engine) == ["after"]


@pytest.mark.parametrize(("name", "call"), ASYNC_CALLS)
@pytest.mark.parametrize("kind", ["Session", "Connection"])
async def test_an_async_function_given_a_sync_bind_raises_type_error_before_any_sql(
    pgtask_engine: Engine, name: str, call: AsyncCall, kind: str
) -> None:
    seen = statements_of(pgtask_engine)
    with sync_bind(pgtask_engine, kind) as bind:
        with pytest.raises(TypeError, match=rf"^{name}_async\(\) needs .*; for a {kind} use "
                                            rf"{name}\(\)$"):
            await call(bind)
        assert seen == []  # before the fix, the INSERT had run by now
        enqueue(bind, "after")
        bind.commit()
    assert task_names(pgtask_engine) == ["after"]


@pytest.mark.parametrize(("name", "call"), SYNC_CALLS)
async def test_a_sync_function_given_an_engine_raises_type_error_and_writes_nothing(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, name: str, call: SyncCall
) -> None:
    seen = statements_of(pgtask_engine)
    with pytest.raises(TypeError, match=rf"^{name}\(\) needs .*, not an Engine, which has no "
                                        r"transaction to join: pass your session, or the "
                                        r"connection of `with engine.begin\(\) as connection:`$"):
        call(pgtask_engine)
    with pytest.raises(TypeError, match=rf"; for an AsyncEngine use {name}_async\(\)$"):
        call(pgtask_async_engine)
    assert seen == []
    assert task_names(pgtask_engine) == []


@pytest.mark.parametrize(("name", "call"), ASYNC_CALLS)
async def test_an_async_function_given_an_engine_raises_type_error_and_writes_nothing(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, name: str, call: AsyncCall
) -> None:
    seen = statements_of(pgtask_engine)
    with pytest.raises(TypeError, match=rf"^{name}_async\(\) needs .*, not an AsyncEngine, "
                                        r"which has no transaction to join"):
        await call(pgtask_async_engine)
    with pytest.raises(TypeError, match=rf"; for an Engine use {name}\(\)$"):
        await call(pgtask_engine)
    assert seen == []
    assert task_names(pgtask_engine) == []


def test_get_task_needs_a_session_because_it_returns_a_mapped_task(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as connection, pytest.raises(
        TypeError, match=r"^get_task\(\) needs a Session \(it returns a mapped Task\); "
                         r"got a Connection$"
    ):
        get_task(connection, uuid.uuid4())  # type: ignore[arg-type]


async def test_the_waiters_need_an_engine_of_their_own_kind(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    with pytest.raises(TypeError, match=r"^wait_for_result\(\) needs an Engine .*; for an "
                                        r"AsyncEngine use wait_for_result_async\(\)$"):
        wait_for_result(pgtask_async_engine, uuid.uuid4())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^wait_for_result_async\(\) needs an AsyncEngine "
                                        r".*; for an Engine use wait_for_result\(\)$"):
        await wait_for_result_async(pgtask_engine, uuid.uuid4())  # type: ignore[arg-type]
    with Session(pgtask_engine) as session, pytest.raises(
        TypeError, match=r"needs an Engine to open its own connections; got a Session$"
    ):
        wait_for_result(session, uuid.uuid4())  # type: ignore[arg-type]


# -- scoped sessions -----------------------------------------------------------------------


def test_a_scoped_session_stands_for_its_current_session_without_flushing_it(
    pgtask_engine: Engine,
) -> None:
    scoped = scoped_session(sessionmaker(pgtask_engine))
    try:
        scoped.add(Queue(name="business-row"))  # pending: the caller has not flushed it
        task_id = enqueue(scoped, "one").id
        enqueue_many(scoped, [EnqueueRequest(name="two")])
        assert cancel(scoped, uuid.uuid4()) is None
        configure_queue(scoped, "settings")
        assert [q.name for q in list_queues(scoped)] == ["settings"]
        assert scoped.new, "the caller's pending object was flushed"
        scoped.commit()
        assert get_task(scoped, task_id) is scoped.get(Task, task_id)
        assert scoped.scalar(select(func.count()).select_from(Queue)) == 2
    finally:
        scoped.remove()
    assert task_names(pgtask_engine) == ["one", "two"]


async def test_an_async_scoped_session_stands_for_its_current_session_without_flushing_it(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    scoped = async_scoped_session(
        async_sessionmaker(pgtask_async_engine), scopefunc=asyncio.current_task
    )
    try:
        scoped.add(Queue(name="business-row"))
        task_id = (await enqueue_async(scoped, "one")).id
        await enqueue_many_async(scoped, [EnqueueRequest(name="two")])
        assert await cancel_async(scoped, uuid.uuid4()) is None
        assert scoped.new, "the caller's pending object was flushed"
        await scoped.commit()
        assert await get_task_async(scoped, task_id) is await scoped.get(Task, task_id)
    finally:
        await scoped.remove()
    assert task_names(pgtask_engine) == ["one", "two"]


# -- the schema is not installed -----------------------------------------------------------

INSTALL_HINT = r"run `pgtask migrate` or `alembic upgrade heads`"

SYNC_ON_EMPTY: list[Any] = [
    pytest.param(lambda e: _in_session(e, lambda s: enqueue(s, "t")), id="enqueue"),
    pytest.param(lambda e: _in_session(e, lambda s: enqueue(s, "t", idempotency_key="k")),
                 id="enqueue-idempotent"),
    pytest.param(lambda e: _in_session(e, lambda s: enqueue_many(
        s, [EnqueueRequest(name="a"), EnqueueRequest(name="b", priority=2)])),
        id="enqueue_many"),
    pytest.param(lambda e: _in_session(e, lambda s: get_task(s, uuid.uuid4())), id="get_task"),
    pytest.param(lambda e: _in_session(e, lambda s: cancel(s, uuid.uuid4())), id="cancel"),
    pytest.param(lambda e: _in_session(e, lambda s: configure_queue(s, "q", paused=True)),
                 id="configure_queue"),
    pytest.param(lambda e: _in_session(e, list_queues), id="list_queues"),
    pytest.param(lambda e: wait_for_result(e, uuid.uuid4(), timeout=5), id="wait_for_result"),
]
ASYNC_ON_EMPTY: list[Any] = [
    pytest.param(lambda s: enqueue_async(s, "t"), id="enqueue_async"),
    pytest.param(lambda s: enqueue_many_async(s, [EnqueueRequest(name="a")]),
                 id="enqueue_many_async"),
    pytest.param(lambda s: get_task_async(s, uuid.uuid4()), id="get_task_async"),
    pytest.param(lambda s: cancel_async(s, uuid.uuid4()), id="cancel_async"),
    pytest.param(lambda s: configure_queue_async(s, "q", max_outstanding_tasks=None),
                 id="configure_queue_async"),
    pytest.param(list_queues_async, id="list_queues_async"),
]


def _in_session(engine: Engine, call: Callable[[Session], object]) -> object:
    with Session(engine) as session:
        return call(session)


def assert_schema_not_installed(error: SchemaNotInstalled) -> None:
    cause = error.__cause__
    assert isinstance(cause, DBAPIError)
    assert getattr(cause.orig, "sqlstate", None) in {"42P01", "3F000", "42883"}


@pytest.mark.parametrize("call", SYNC_ON_EMPTY)
def test_sync_functions_on_a_database_without_the_schema_say_how_to_install_it(
    empty_engine: Engine, call: Callable[[Engine], object]
) -> None:
    with pytest.raises(SchemaNotInstalled, match=INSTALL_HINT) as caught:
        call(empty_engine)
    assert_schema_not_installed(caught.value)


@pytest.mark.parametrize("call", ASYNC_ON_EMPTY)
async def test_async_functions_on_a_database_without_the_schema_say_how_to_install_it(
    pgtask_empty_database_url: str, call: AsyncCall
) -> None:
    engine = create_async_engine(pgtask_empty_database_url)
    try:
        async with AsyncSession(engine) as session:
            with pytest.raises(SchemaNotInstalled, match=INSTALL_HINT) as caught:
                await call(session)
        assert_schema_not_installed(caught.value)
        with pytest.raises(SchemaNotInstalled, match=INSTALL_HINT) as caught:
            await wait_for_result_async(engine, uuid.uuid4(), timeout=5)
        assert_schema_not_installed(caught.value)
    finally:
        await engine.dispose()


def test_only_missing_objects_in_schema_pgtask_mean_the_schema_is_not_installed(
    empty_engine: Engine,
) -> None:
    def run(sql: str) -> None:
        with empty_engine.connect() as connection, translated_errors():
            connection.execute(text(sql))

    with pytest.raises(SchemaNotInstalled):  # 3F000: schema "pgtask" does not exist
        run("SELECT pgtask.wake()")
    with empty_engine.begin() as connection:
        connection.execute(text("CREATE SCHEMA pgtask"))
        connection.execute(text("CREATE TABLE pgtask_notes (id int)"))
    with pytest.raises(SchemaNotInstalled):  # 42883: function pgtask.wake() does not exist
        run("SELECT pgtask.wake()")
    with pytest.raises(SchemaNotInstalled):  # 42P01, schema present but empty
        run("SELECT * FROM pgtask.tasks")
    # Someone else's missing objects pass through untouched.
    for sql in ("SELECT * FROM public.orders", "SELECT wake()", "SELECT * FROM app.pgtask",
                "DROP TABLE pgtask_missing", "SELECT * FROM mypgtask.tasks"):
        with pytest.raises(ProgrammingError) as caught:
            run(sql)
        assert not isinstance(caught.value, SchemaNotInstalled), sql


async def test_a_worker_given_a_url_bounds_its_network_waits(pgtask_database_url: str) -> None:
    # libpq's settings the worker adds to a URL's own: without them a server that stops
    # answering held a connect or a statement until the kernel gave up (minutes).
    for url, connect_timeout in (
        (pgtask_database_url, "10"),
        (f"{pgtask_database_url}?connect_timeout=3", "3"),  # the URL's own setting wins
    ):
        engine = owned_engine(url)
        try:
            async with engine.connect() as connection:
                raw = await connection.get_raw_connection()
                parameters = raw.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        finally:
            await engine.dispose()
        assert parameters["connect_timeout"] == connect_timeout
        assert {k: parameters[k] for k in NETWORK_DEFAULTS if k != "connect_timeout"} == {
            k: v for k, v in NETWORK_DEFAULTS.items() if k != "connect_timeout"
        }
