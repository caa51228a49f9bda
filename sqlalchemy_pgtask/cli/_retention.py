"""cli._retention: ``pgtask retention run``: delete expired history now, and say what went.

Calls `run_retention`, whose batches each commit on their own; an interrupted run keeps what
it deleted. Options are checked by the library before any SQL (a usage error, exit code 2).
"""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.cli._connection import URL_ENV, database_url
from sqlalchemy_pgtask.cli._errors import EXIT_OK
from sqlalchemy_pgtask.cli._types import int_between, seconds
from sqlalchemy_pgtask.errors import SchemaNotInstalled
from sqlalchemy_pgtask.retention import (
    BATCH_SIZE_MAX,
    WORKER_RETENTION_SECONDS,
    RetentionResult,
    run_retention,
)
from sqlalchemy_pgtask.validation import check_queue_name

__all__ = ["add_commands", "result_line", "retention_run"]


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def result_line(result: RetentionResult, *, queue: str | None) -> str:
    """What a run deleted, in one line."""
    scope = f" of queue {queue}" if queue is not None else ""
    parts = [
        _plural(result.tasks_deleted, "finished task"),
        _plural(result.keys_deleted, "idempotency key"),
    ]
    if queue is None:
        parts.append(_plural(result.workers_deleted, "worker row"))
    batches = _plural(result.batches, "batch", "batches")
    more = " (stopped at --max-batches: more may be left)" if result.stopped_early else ""
    if result.kinds_cut_short:
        more += f" (cut short: {', '.join(result.kinds_cut_short)}; run it again)"
    return f"deleted {', '.join(parts)}{scope} in {batches}{more}"


def retention_run(args: argparse.Namespace) -> int:
    if args.queue is not None:
        check_queue_name(args.queue, "--queue")  # a usage error, before connecting
    engine = create_engine(database_url(args), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            if not status.schema_installed(connection):
                raise SchemaNotInstalled()
        result = run_retention(
            engine,
            queue=args.queue,
            batch_size=args.batch_size,
            max_batches=args.max_batches,
            worker_retention=args.worker_retention,
        )
    finally:
        engine.dispose()
    print(result_line(result, queue=args.queue))
    return EXIT_OK


def add_commands(commands: Any) -> None:
    """Add this module's commands to the ``pgtask`` parser's subcommands."""
    retention = commands.add_parser(
        "retention", help="delete expired task history and idempotency keys now"
    )
    actions = retention.add_subparsers(dest="retention_command", metavar="ACTION", required=True)
    run = actions.add_parser(
        "run",
        help="delete what is past its queue's retention, in batches, until nothing is left",
        description=(
            "Delete finished tasks (with their attempts, steps, signals and waits) older than "
            "their queue's terminal retention, a workflow's tasks all together once all "
            "are; idempotency keys "
            "whose reservation expired (never one that has not); and rows of workers long "
            "gone. Each batch commits on its own and skips rows others hold, so it is safe "
            "to run while workers run (they run retention too)."
        ),
    )
    run.add_argument("--queue", metavar="QUEUE", help="only this queue's tasks and keys")
    run.add_argument(
        "--batch-size", type=int_between(1, BATCH_SIZE_MAX), default=1000, metavar="N",
        help="rows per batch, each its own transaction; a workflow's tasks are never split"
        " across batches (default: %(default)s)",
    )
    run.add_argument(
        "--max-batches", type=int_between(1, 2**31 - 1), metavar="N",
        help="stop after N batches of each kind (default: until nothing is left)",
    )
    run.add_argument(
        "--worker-retention", type=seconds, default=WORKER_RETENTION_SECONDS,
        metavar="SECONDS",
        help="keep a worker's row this long after it expired (default: %(default)s)",
    )
    run.add_argument(
        "--database-url",
        metavar="URL",
        help=f"PostgreSQL URL, e.g. postgresql://user@host/db (default: ${URL_ENV})",
    )
    run.set_defaults(handler=retention_run)
