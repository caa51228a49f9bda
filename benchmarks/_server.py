"""benchmarks/_server.py: where a benchmark's PostgreSQL comes from, and its throwaway database.

``--database-url`` when given, else the server that ``provide_server(url_env=
"PGTASK_BENCH_DATABASE_URL", allow_docker=False)`` finds or starts, as the test fixture does
(never a container: its CPU and network limits would be part of the figures).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from sqlalchemy import make_url

from sqlalchemy_pgtask.migrations import HEAD, upgrade
from sqlalchemy_pgtask.testing import create_database, drop_database, provide_server

__all__ = ["Server", "libpq_url", "psycopg_url", "scratch_database", "server"]


def libpq_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql+psycopg").render_as_string(
        hide_password=False
    )


class Server(NamedTuple):
    url: str
    #: For a report: the URL without its password, or how the server was found.
    description: str


@contextlib.contextmanager
def server(database_url: str | None) -> Iterator[Server]:
    if database_url:
        yield Server(database_url, make_url(database_url).render_as_string(hide_password=True))
        return
    with provide_server(url_env="PGTASK_BENCH_DATABASE_URL", allow_docker=False) as info:
        yield Server(info.url, info.description)


@contextlib.contextmanager
def scratch_database(
    database_url: str | None, name: str, revision: str | None = HEAD
) -> Iterator[str]:
    """A new database called after ``name`` on `server`'s server, migrated to ``revision``
    (None: left empty); its URL (driver psycopg), dropped afterwards."""
    with server(database_url) as found:
        raw = create_database(found.url, name)
        try:
            url = psycopg_url(raw)
            if revision is not None:
                upgrade(url, revision)
            yield url
        finally:
            drop_database(raw)
