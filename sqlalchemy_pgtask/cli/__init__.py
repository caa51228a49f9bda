"""cli: the ``pgtask`` command; parses arguments, calls the library and prints what it returns,
holding no logic of its own; never lets a traceback reach the operator for an expected error.

Exit codes: 0 success, 1 an operational failure (database unreachable, a database error such
as a missing privilege or a damaged schema, the schema not installed, a task not found), 2 a
usage error (bad arguments, a URL that does not parse, a registry that does not import). Every
error is one line on stderr, ``pgtask: error: ...``.

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
import sys
from collections.abc import Callable, Sequence

from sqlalchemy_pgtask.cli._arguments import build_parser
from sqlalchemy_pgtask.cli._errors import describe

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pgtask`` command line and return its exit code."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (Exception, KeyboardInterrupt) as exc:
        failure = describe(exc)
        if failure is None:
            raise  # a bug: its traceback is what a report needs
        code, message = failure
        print(f"pgtask: error: {message}", file=sys.stderr)
        raise SystemExit(code) from None

