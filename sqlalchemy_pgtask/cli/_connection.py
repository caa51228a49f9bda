"""The ``pgtask`` command's database access: which URL, and one transaction per command; never
reads or writes tables itself.

Commands that only look (``status``, ``task list``, ``task show``, ``queue list``) run in a
read-only ``REPEATABLE READ`` transaction: their several statements see one snapshot, so the
counts of one queue add up, and the server refuses any write a read model might attempt.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from typing import Final, TypeVar

from sqlalchemy import Connection, create_engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import SchemaNotInstalled, status
from sqlalchemy_pgtask.cli._errors import UsageError

__all__ = ["URL_ENV", "database_url", "in_transaction"]

URL_ENV: Final = "PGTASK_DATABASE_URL"

_T = TypeVar("_T")

#: The password of a URL that did not parse (so SQLAlchemy cannot hide it for us): all up to
#: the last ``@``, since an unencoded password may hold ``/`` or ``@`` itself (a base64 one
#: often does). Hiding too much of a broken URL is harmless; echoing part of a password is not.
_PASSWORD: Final = re.compile(r"(://[^:/@]*:).*@")


def _redacted(raw: str) -> str:
    return _PASSWORD.sub(r"\1***@", raw)


def database_url(args: argparse.Namespace) -> str:
    """The ``--database-url`` or ``$PGTASK_DATABASE_URL``, as a psycopg 3 URL.

    Any PostgreSQL URL form is accepted (``postgresql://``, ``postgresql+psycopg2://`` ...):
    the library speaks psycopg 3 whatever the URL names. A URL SQLAlchemy cannot parse (a port
    that is not a number, say) is a usage error.
    """
    raw = args.database_url or os.environ.get(URL_ENV)
    if not raw:
        raise UsageError(f"no database URL: pass --database-url or set {URL_ENV}")
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        # make_url raises ValueError (int() of the port) for postgresql://u@h:abc/db.
        raise UsageError(f"invalid database URL {_redacted(raw)!r}: {exc}") from exc
    if url.get_backend_name() != "postgresql":
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
