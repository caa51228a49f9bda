"""cli._grants: ``pgtask grants``, least-privilege roles: prints or runs the library's GRANT
statements (`sqlalchemy_pgtask.grants`); holds no privilege list of its own.
"""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy import Connection

from sqlalchemy_pgtask.cli._connection import in_transaction
from sqlalchemy_pgtask.cli._errors import EXIT_OK, UsageError
from sqlalchemy_pgtask.grants import LEVELS, grant_roles, grants_sql

__all__ = ["add_commands", "grants"]

_HELP = {
    "producer": "enqueues, emits signals and reads tasks",
    "worker": "runs workers: claims, outcomes, durable steps and maintenance",
    "observer": "reads status, tasks, queues, schedules and the audit log; writes nothing",
    "admin": "retries and cancels tasks, configures queues and schedules, runs retention",
}


def _roles(args: argparse.Namespace) -> dict[str, str | None]:
    roles: dict[str, str | None] = {level: getattr(args, level) for level in LEVELS}
    if all(role is None for role in roles.values()):
        raise UsageError("name at least one role: --producer, --worker, --observer or --admin")
    return roles


def grants(args: argparse.Namespace) -> int:
    roles = _roles(args)
    sql = grants_sql(**roles)  # checks every name before connecting
    if args.print_sql:
        print(sql, end="")
        return EXIT_OK

    def run(connection: Connection) -> None:
        grant_roles(connection, **roles)

    in_transaction(args, run, read_only=False)
    granted = ", ".join(f"{level} {role}" for level, role in roles.items() if role is not None)
    print(f"granted: {granted}")
    return EXIT_OK


def add_commands(commands: Any) -> None:
    """Add ``pgtask grants`` to the ``pgtask`` parser's subcommands."""
    parser = commands.add_parser(
        "grants",
        help="grant least privilege to the roles of producers, workers, observers and admins",
        description=(
            "Grant each given role (which must exist) the privileges of its level on the "
            "pgtask schema, after revoking what PUBLIC has there; run as the schema's owner. "
            "Grants add up: use one role per level. See docs/roles.md."
        ),
    )
    for level in LEVELS:
        parser.add_argument(f"--{level}", metavar="ROLE", help=_HELP[level])
    parser.add_argument(
        "--print-sql", action="store_true",
        help="print the statements instead of running them (no database needed)",
    )
    parser.add_argument(
        "--database-url", metavar="URL",
        help="PostgreSQL URL of the schema's owner (default: $PGTASK_DATABASE_URL)",
    )
    parser.set_defaults(handler=grants)
