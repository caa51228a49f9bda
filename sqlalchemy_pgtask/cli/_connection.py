"""The ``pgtask`` command's database access: which URL, and one transaction per command; never
reads or writes tables itself.

Commands that only look (``status``, ``task list``, ``task show``, ``queue list``) run in a
read-only ``REPEATABLE READ`` transaction: their several statements see one snapshot, so the
counts of one queue add up, and the server refuses any write a read model might attempt.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Final, TypeVar

from sqlalchemy import Connection, create_engine
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import _url, status
from sqlalchemy_pgtask.cli._errors import UsageError
from sqlalchemy_pgtask.errors import SchemaNotInstalled

__all__ = ["URL_ENV", "database_url", "in_transaction"]

URL_ENV: Final = "PGTASK_DATABASE_URL"

_T = TypeVar("_T")

def database_url(args: argparse.Namespace) -> str:
    """The ``--database-url`` or ``$PGTASK_DATABASE_URL``, as a psycopg 3 URL.

    Any PostgreSQL URL form is accepted (``postgresql://``, ``postgresql+psycopg2://`` ...,
    libpq's multi-host ``postgresql://u@h1,h2/db?target_session_attrs=read-write``): the
    library speaks psycopg 3 whatever the URL names. A URL that does not parse (a port that is
    not a number, say) is a usage error.
    """
    raw = args.database_url or os.environ.get(URL_ENV)
    if not raw:
        raise UsageError(f"no database URL: pass --database-url or set {URL_ENV}")
    try:
        url = _url.parse(raw)
    except ValueError as exc:
        raise UsageError(f"invalid database URL {_url.redacted(raw)!r}: {exc}") from exc
    if url.get_backend_name() not in ("postgresql", "postgres"):
        raise UsageError(f"pgtask needs PostgreSQL, got a {url.get_backend_name()!r} URL")
    return url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def in_transaction(
    args: argparse.Namespace,
    action: Callable[[Connection], _T],
    *,
    read_only: bool,
) -> _T:
    """Run ``action`` in one transaction on the command's database; commit if it writes.

    Raises `SchemaNotInstalled` before ``action`` runs when the schema is missing.
    """
    engine = create_engine(database_url(args), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            if read_only:
                connection.execution_options(
                    isolation_level="REPEATABLE READ", postgresql_readonly=True
                )
            if not status.schema_installed(connection):
                raise SchemaNotInstalled()
            result = action(connection)
            if read_only:
                connection.rollback()
            else:
                connection.commit()
            return result
    finally:
        engine.dispose()
