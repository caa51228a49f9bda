"""The operator commands (``status``, ``task ...``, ``queue ...``, ``audit``): call the library
and print what it returns; never query or change tables themselves.

Reads go through the read models of `sqlalchemy_pgtask.status` and `list_audit`; the writes
are the library's own `cancel`, `retry`, `pause_queue`, `resume_queue` and `configure_queue`,
each in a transaction the command commits, each audited with ``--actor`` (default: the
operating system user) and ``--reason``. Also here: the argument types of these commands'
options (a rate such as ``100/30s``), which the grammar in `_arguments` refers to.
"""

from __future__ import annotations

import argparse
import getpass
import math
import re
from typing import Any, Final

from sqlalchemy import Connection

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.admin import pause_queue, resume_queue, retry
from sqlalchemy_pgtask.audit import AUDIT_LIMIT_MAX, AuditRecord, list_audit
from sqlalchemy_pgtask.cli import _render
from sqlalchemy_pgtask.cli._connection import in_transaction
from sqlalchemy_pgtask.cli._errors import EXIT_OK, UsageError
from sqlalchemy_pgtask.client import cancel
from sqlalchemy_pgtask.errors import QueueFull, TaskNotFound
from sqlalchemy_pgtask.queues import configure_queue, list_queues
from sqlalchemy_pgtask.states import RUNNING

__all__ = [
    "AUDIT_LIMIT_MAX",
    "add_audit_options",
    "audit_list",
    "default_actor",
    "positive_seconds_argument",
    "queue_list",
    "queue_pause",
    "queue_resume",
    "queue_set",
    "rate_argument",
    "show_status",
    "task_cancel",
    "task_list",
    "task_retry",
    "task_show",
]

_RATE: Final = re.compile(
    r"(\d+)(?:/(\d+(?:\.\d*)?)?(s|m|h|d|sec|second|min|minute|hour|day))?"
)
_UNIT_SECONDS: Final = {
    "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
    "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0,
}


def rate_argument(text: str) -> tuple[int, float | None]:
    """``N/s``, ``N/m``, ``N/h``, ``N/d`` (or ``/second``, ``/minute``...), ``N/<count><unit>``
    (``100/30s``), or a bare ``N`` (its period from ``--rate-period``, else a second): a rate
    limit and its period in seconds (None: not given)."""
    match = _RATE.fullmatch(text.replace(" ", ""))
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rate: write N/s, N/m, N/h, N/d or N/<seconds>s (e.g. 100/30s)"
        )
    limit, count, unit = match.groups()
    if unit is None:
        if not 1 <= int(limit) <= 2**31 - 1:
            raise argparse.ArgumentTypeError(f"the count of {text!r} must be 1 to {2**31 - 1}")
        return int(limit), None
    period = (float(count) if count else 1.0) * _UNIT_SECONDS[unit]
    if not 1 <= int(limit) <= 2**31 - 1:
        raise argparse.ArgumentTypeError(f"the count of {text!r} must be 1 to {2**31 - 1}")
    if not (math.isfinite(period) and period > 0):
        raise argparse.ArgumentTypeError(f"the period of {text!r} must be positive")
    return int(limit), period


def positive_seconds_argument(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_audit_options(parser: argparse.ArgumentParser) -> None:
    """``--actor`` and ``--reason`` of a command that writes an audit entry."""
    parser.add_argument(
        "--actor", metavar="NAME",
        help="who is recorded in the audit log, 1 to 255 bytes (default: your operating "
        "system user name, from getpass.getuser(); the database role if it has none)",
    )
    parser.add_argument(
        "--reason", metavar="TEXT", help="why, recorded in the audit log (at most 1000 bytes)"
    )


def default_actor() -> str | None:
    """The operating system user's name, or None (the database role is recorded then)."""
    try:
        return getpass.getuser() or None
    except (OSError, KeyError, ImportError):  # no $USER and no passwd entry (a container)
        return None


def _audited(args: argparse.Namespace) -> dict[str, Any]:
    actor = args.actor if args.actor is not None else default_actor()
    return {"actor": actor, "reason": args.reason}


def _print(lines: list[str]) -> None:
    """Print each line with its control characters escaped (`_render.printable`)."""
    for line in lines:
        print(_render.printable(line))


def show_status(args: argparse.Namespace) -> int:
    def read(connection: Connection) -> list[str]:
        return _render.status_lines(
            status.live_workers(connection),
            status.queue_status(connection),
            status.unroutable(connection),
            status.held_back(connection),
        )

    _print(in_transaction(args, read, read_only=True))
    return EXIT_OK


def task_list(args: argparse.Namespace) -> int:
    filters: dict[str, Any] = {
        "state": args.state, "queue": args.queue, "name": args.name, "limit": args.limit,
        "key": args.key,
    }
    status.check_list_filters(**filters)  # before connecting: a usage error needs no database
    before = None if args.before is None else status.parse_task_id(args.before)

    def read(connection: Connection) -> list[status.TaskSummary]:
        return status.list_tasks(connection, before=before, **filters)

    _print(_render.task_list_lines(in_transaction(args, read, read_only=True), args.limit))
    return EXIT_OK


def task_show(args: argparse.Namespace) -> int:
    task_id = status.parse_task_id(args.task_id)

    def read(connection: Connection) -> status.TaskDetail | None:
        return status.task_detail(connection, task_id)

    task = in_transaction(args, read, read_only=True)
    if task is None:
        raise TaskNotFound(f"no task with id {task_id}")
    _print([_render.task_detail_json(task)] if args.json else _render.task_detail_lines(task))
    return EXIT_OK


def task_cancel(args: argparse.Namespace) -> int:
    task_id = status.parse_task_id(args.task_id)
    audited = _audited(args)

    def run(connection: Connection) -> str:
        state = cancel(connection, task_id, **audited)
        if state is not None:
            if state == RUNNING:
                return f"task {task_id}: cancellation requested; its worker will stop it"
            return f"task {task_id}: {state}"
        # cancel() says None both for "no such task" and "already finished": look.
        found = status.task_summary(connection, task_id)
        if found is None:
            raise TaskNotFound(f"no task with id {task_id}")
        return f"task {task_id} had already finished: {found.state}"

    _print([in_transaction(args, run, read_only=False)])
    return EXIT_OK


def task_retry(args: argparse.Namespace) -> int:
    task_id = status.parse_task_id(args.task_id)
    audited = _audited(args)

    def run(connection: Connection) -> str:
        try:
            previous = retry(connection, task_id, **audited)
        except QueueFull as exc:
            raise QueueFull(f"cannot retry task {task_id}: {exc}; try again later") from exc
        return f"task {task_id}: pending again (was {previous})"

    _print([in_transaction(args, run, read_only=False)])
    return EXIT_OK


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `configure_queue` options ``queue set`` was given."""
    options: dict[str, Any] = {}
    if args.no_capacity:
        options["max_outstanding_tasks"] = None
    elif args.capacity is not None:
        options["max_outstanding_tasks"] = args.capacity
    if args.paused is not None:
        options["paused"] = args.paused
    if args.terminal_retention is not None:
        options["terminal_retention_seconds"] = args.terminal_retention
    if args.idempotency_retention is not None:
        options["idempotency_retention_seconds"] = args.idempotency_retention
    if args.no_rate_limit:
        options["rate_limit"] = None
    elif args.rate_limit is not None:
        limit, period = args.rate_limit
        if period is not None and args.rate_period is not None:
            raise UsageError(
                "give the period in --rate-limit (N/PERIOD) or --rate-period, not both"
            )
        options["rate_limit"] = limit
        options["rate_period"] = period if period is not None else args.rate_period or 1.0
    elif args.rate_period is not None:
        raise UsageError("--rate-period needs --rate-limit N")
    if args.no_starvation_timeout:
        options["starvation_timeout"] = None
    elif args.starvation_timeout is not None:
        options["starvation_timeout"] = args.starvation_timeout
    return options


def queue_set(args: argparse.Namespace) -> int:
    options = {**_settings(args), **_audited(args)}

    def run(connection: Connection) -> list[status.QueueSettings]:
        configure_queue(connection, args.name, **options)
        return [q for q in list_queues(connection) if q.name == args.name]

    _print([_render.queue_settings_line(q) for q in in_transaction(args, run, read_only=False)])
    return EXIT_OK


def queue_pause(args: argparse.Namespace) -> int:
    audited = _audited(args)

    def run(connection: Connection) -> status.QueueSettings:
        return pause_queue(connection, args.name, **audited)

    _print([_render.queue_settings_line(in_transaction(args, run, read_only=False))])
    return EXIT_OK


def queue_resume(args: argparse.Namespace) -> int:
    audited = _audited(args)

    def run(connection: Connection) -> status.QueueSettings:
        return resume_queue(connection, args.name, **audited)

    _print([_render.queue_settings_line(in_transaction(args, run, read_only=False))])
    return EXIT_OK


def queue_list(args: argparse.Namespace) -> int:
    queues = in_transaction(args, list_queues, read_only=True)
    if not queues:
        _print(["no queue has settings; every queue uses the defaults"])
    _print([_render.queue_settings_line(q) for q in queues])
    return EXIT_OK


def audit_list(args: argparse.Namespace) -> int:
    task_id = None if args.task is None else status.parse_task_id(args.task)
    filters: dict[str, Any] = {
        "task_id": task_id, "queue": args.queue, "schedule": args.schedule,
        "limit": args.limit, "before_id": args.before,
    }

    def read(connection: Connection) -> list[AuditRecord]:
        return list_audit(connection, **filters)

    entries = in_transaction(args, read, read_only=True)
    if args.json:
        _print([_render.audit_json(entries)])
    else:
        _print(_render.audit_lines(entries, args.limit))
    return EXIT_OK
