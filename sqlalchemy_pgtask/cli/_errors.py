"""The ``pgtask`` command's error boundary: every expected failure becomes an exit code and one
line of text; never prints, never exits.

Exit code 2 means the command was called wrongly (arguments, URL, a registry that does not
import): fixing the command line fixes it. Exit code 1 means the command was right and the
world was not (the database refused, the schema is missing or damaged, a file could not be
written). Database errors come from two layers, SQLAlchemy (which wraps the driver's error as
``.orig``) and psycopg itself (the worker's ``LISTEN`` connection is plain psycopg); both are
described from the driver's error: its first line, its SQLSTATE, and a hint for the states an
operator can act on.
"""

from __future__ import annotations

import sys
from typing import Final

import psycopg
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from sqlalchemy_pgtask.errors import PgTaskError, ValidationError, WorkerCrashed

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_OUTPUT_CLOSED",
    "EXIT_USAGE",
    "UsageError",
    "describe",
]

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130
#: 128 + SIGPIPE: what a shell reports for a command whose reader went away (``| head -1``).
EXIT_OUTPUT_CLOSED: Final = 141

_SCHEMA_HINT: Final = (
    "the pgtask schema looks incomplete or out of date: run `pgtask migrate` or "
    "`alembic upgrade heads`"
)
#: What an operator can do about a server error, by SQLSTATE.
_HINTS: Final = {
    "42P01": _SCHEMA_HINT,  # undefined_table
    "42703": _SCHEMA_HINT,  # undefined_column
    "42883": _SCHEMA_HINT,  # undefined_function
    "3F000": _SCHEMA_HINT,  # invalid_schema_name
    "42501": "the database role lacks a privilege pgtask needs",  # insufficient_privilege
    "25006": "the server only accepts reads (a standby?)",  # read_only_sql_transaction
}


class UsageError(Exception):
    """A mistake in how the command was called."""


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else text.strip()


def _database(error: BaseException) -> str:
    """One line about a driver or server error, without the statement and its parameters."""
    reason = _one_line(str(error)) or type(error).__name__
    sqlstate = getattr(error, "sqlstate", None)
    if not sqlstate:
        if isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError)):
            # Raised by the client, not the server: no connection was made, or it was lost.
            return f"cannot reach the database: {reason}"
        # The server answered; the client could not turn a value it sent into Python (a
        # timestamp of 'infinity' written by hand, say).
        return f"cannot read what the database sent: {reason}"
    hint = _HINTS.get(sqlstate)
    detail = f" ({hint})" if hint else ""
    return f"database error {sqlstate}: {reason}{detail}"


def _alembic_command_error(error: BaseException) -> bool:
    # Only a command that ran Alembic can raise its errors, and only that command pays for
    # importing it (~0.2 s of every `pgtask` start otherwise).
    util = sys.modules.get("alembic.util")
    return util is not None and isinstance(error, util.CommandError)


def describe(error: BaseException) -> tuple[int, str] | None:
    """The exit code and one-line message for an expected error; None for anything else
    (a bug, whose traceback should be seen)."""
    if isinstance(error, (UsageError, ValidationError)) or _alembic_command_error(error):
        return EXIT_USAGE, _one_line(str(error))
    if isinstance(error, DBAPIError) and error.orig is not None:
        if isinstance(error.orig, psycopg.Error):
            return EXIT_FAILURE, _database(error.orig)
        return EXIT_FAILURE, f"database error: {_one_line(str(error.orig))}"
    if isinstance(error, psycopg.Error):
        return EXIT_FAILURE, _database(error)
    if isinstance(error, SQLAlchemyError):
        return EXIT_FAILURE, f"database error: {_one_line(str(error))}"
    if isinstance(error, WorkerCrashed) and error.loop and error.__cause__ is not None:
        # The loop's own error, described like any other (its SQLSTATE and hint, not its
        # statement): the line an operator acts on.
        cause = describe(error.__cause__)
        if cause is not None:
            return EXIT_FAILURE, f"the worker's {error.loop} loop failed: {cause[1]}"
    if isinstance(error, PgTaskError):
        return EXIT_FAILURE, _one_line(str(error))
    if isinstance(error, OSError):
        return EXIT_FAILURE, _one_line(str(error))
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    return None
