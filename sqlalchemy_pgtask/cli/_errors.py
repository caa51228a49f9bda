"""The ``pgtask`` command's error boundary: every expected failure becomes an exit code and one
line of text; never prints, never exits.

Exit code 2 means the command was called wrongly (arguments, URL, a registry that does not
import): fixing the command line fixes it. Exit code 1 means the command was right and the
world was not (the database is unreachable, the schema is missing, no such task).
"""

from __future__ import annotations

from typing import Final

from alembic.util import CommandError
from sqlalchemy.exc import OperationalError

from sqlalchemy_pgtask import PgTaskError, ValidationError

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError", "describe"]

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130


class UsageError(Exception):
    """A mistake in how the command was called."""


def describe(error: BaseException) -> tuple[int, str] | None:
    """The exit code and one-line message for an expected error; None for anything else
    (a bug, whose traceback should be seen)."""
    if isinstance(error, (UsageError, CommandError, ValidationError)):
        return EXIT_USAGE, str(error)
    if isinstance(error, OperationalError):
        reason = str(error.orig).strip().splitlines()[0] if error.orig else str(error)
        return EXIT_FAILURE, f"cannot reach the database: {reason}"
    if isinstance(error, PgTaskError):
        return EXIT_FAILURE, str(error)
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    return None
