"""cli: the ``pgtask`` command; parses arguments, calls the library and prints what it returns,
holding no logic of its own; never lets a traceback reach the operator for an expected error.

Exit codes: 0 success, 1 an operational failure (database unreachable, a database error such
as a missing privilege or a damaged schema, the schema not installed, a task not found), 2 a
usage error (bad arguments, a URL that does not parse, a registry that does not import), 130
interrupted, 141 (quietly) the standard output closed before all was printed (``| head``).
Every error is one line on stderr, ``pgtask: error: ...``. What is printed is user data with
its control characters escaped (`_render.printable`), and a character the terminal's encoding
lacks is printed as an escape too, never a ``UnicodeEncodeError``.

The package, one concern per module:

* `_arguments`: the grammar (commands, options, defaults read from `WorkerOptions`);
* `_commands`: ``migrate``, ``init-alembic``, ``worker``, ``demo``;
* `_inspect`: ``status``, ``task list|show|cancel``, ``queue list|set``, printing the read
  models of `sqlalchemy_pgtask.status` through `_render`;
* `_connection`: the database URL and the one transaction a command runs in;
* `_errors`: which exceptions are expected, and their exit codes and messages.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Callable, Sequence

from sqlalchemy_pgtask.cli._arguments import build_parser
from sqlalchemy_pgtask.cli._errors import EXIT_OUTPUT_CLOSED, describe
from sqlalchemy_pgtask.cli._render import printable

__all__ = ["main"]


def _discard_stdout() -> None:
    """Point the standard output at /dev/null, so the interpreter's last flush of what is
    still buffered cannot fail again ("Exception ignored ... BrokenPipeError", exit 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (an embedding's stream): nothing to do
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pgtask`` command line and return its exit code."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A payload in a terminal whose encoding lacks its characters (PYTHONIOENCODING=ascii,
        # a Latin-1 locale): print "\xfc" rather than fail with a UnicodeEncodeError.
        sys.stdout.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe is seen here, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`pgtask task list | head -1`): stop quietly, like any Unix
        # command killed by SIGPIPE. Writes to the database were committed before printing.
        _discard_stdout()
        raise SystemExit(EXIT_OUTPUT_CLOSED) from None
    except (Exception, KeyboardInterrupt) as exc:
        failure = describe(exc)
        if failure is None:
            raise  # a bug: its traceback is what a report needs
        code, message = failure
        print(f"pgtask: error: {printable(message)}", file=sys.stderr)
        raise SystemExit(code) from None

