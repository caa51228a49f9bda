"""cli._schedules: ``pgtask schedule list|set|pause|resume|run-now|delete``; calls the library's
schedule functions in one transaction per command and prints what they return.
"""

from __future__ import annotations

import argparse
import json
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from sqlalchemy_pgtask.cli import _render
from sqlalchemy_pgtask.cli._connection import in_transaction
from sqlalchemy_pgtask.cli._errors import EXIT_OK, UsageError
from sqlalchemy_pgtask.schedule import (
    MISFIRE_POLICIES,
    OVERLAP_POLICIES,
    ScheduleInfo,
    delete_schedule,
    list_schedules,
    pause_schedule,
    resume_schedule,
    run_schedule_now,
    set_schedule,
)

__all__ = ["add_commands", "schedule_lines"]


def _when(value: datetime | None) -> str:
    return _render.when(value)


def _print(line: str) -> None:
    """Print ``line`` with its control characters escaped (a last error is user data)."""
    print(_render.printable(line))


def schedule_lines(info: ScheduleInfo) -> list[str]:
    """A schedule as a few lines: definition, cursor, state, last error, upcoming."""
    rhythm = f"cron {info.cron!r} {info.timezone}" if info.cron else (
        f"every {info.interval_seconds:g}s"
    )
    policy = f"misfire={info.misfire}"
    if info.catch_up_limit is not None:
        policy += f"(limit {info.catch_up_limit})"
    state = "paused" if info.paused else "active"
    lines = [
        f"{info.name}: {rhythm} -> {info.task_name} v{info.version} on {info.queue}"
        f" [{state}, {policy}, overlap={info.overlap}"
        f"{', declared' if info.declared else ''}]",
        f"  next run: {_when(info.next_run_at)}   last task: {info.last_task_id or '-'}",
    ]
    if info.last_error:
        lines.append(f"  last error: {info.last_error}")
    if info.upcoming:
        lines.append("  upcoming: " + ", ".join(_when(at) for at in info.upcoming))
    return lines


def _print_all(infos: list[ScheduleInfo]) -> None:
    for info in infos:
        for line in schedule_lines(info):
            _print(line)


def schedule_list(args: argparse.Namespace) -> int:
    def read(connection: Connection) -> list[ScheduleInfo]:
        return list_schedules(connection, upcoming=args.upcoming)

    infos = in_transaction(args, read, read_only=True)
    if not infos:
        _print("no schedules")
    _print_all(infos)
    return EXIT_OK


def _payload(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--payload is not JSON: {exc}") from None


def schedule_set(args: argparse.Namespace) -> int:
    payload = _payload(args.payload)
    start_at = None
    if args.start_at is not None:
        try:
            start_at = datetime.fromisoformat(args.start_at)
        except ValueError:
            raise UsageError(f"--start-at is not an ISO 8601 time: {args.start_at!r}") from None

    def run(connection: Connection) -> ScheduleInfo:
        return set_schedule(
            connection, args.name, task=args.task, cron=args.cron, every=args.every,
            timezone=args.timezone, queue=args.queue, version=args.task_version,
            payload=payload, priority=args.priority, max_attempts=args.max_attempts,
            timeout=args.timeout, misfire=args.misfire, catch_up_limit=args.catch_up_limit,
            overlap=args.overlap, start_at=start_at, actor=args.actor,
        )

    _print_all([in_transaction(args, run, read_only=False)])
    return EXIT_OK


def _change(args: argparse.Namespace) -> int:
    action = {"pause": pause_schedule, "resume": resume_schedule, "delete": delete_schedule}[
        args.schedule_command
    ]

    def run(connection: Connection) -> ScheduleInfo:
        return action(connection, args.name, actor=args.actor, reason=args.reason)

    info = in_transaction(args, run, read_only=False)
    if args.schedule_command == "delete":
        _print(f"schedule {info.name} deleted (its tasks are kept)")
    else:
        _print_all([info])
    return EXIT_OK


def _run_now(args: argparse.Namespace) -> int:
    def run(connection: Connection) -> uuid.UUID:
        return run_schedule_now(connection, args.name, actor=args.actor, reason=args.reason)

    task_id = in_transaction(args, run, read_only=False)
    _print(f"schedule {args.name}: task {task_id} enqueued now")
    return EXIT_OK


def _url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", metavar="URL",
                        help="PostgreSQL URL (default: $PGTASK_DATABASE_URL)")


def _number(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None

    return parse


def add_commands(commands: Any) -> None:
    """Add ``pgtask schedule ...`` to the ``pgtask`` parser's subcommands."""
    schedule = commands.add_parser("schedule", help="list or manage recurring schedules")
    actions = schedule.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)

    listing = actions.add_parser(
        "list", help="every schedule: definition, next run, state, last error, upcoming runs"
    )
    listing.add_argument("--upcoming", type=_number(int), default=3, metavar="N",
                         help="upcoming occurrences to show (default: %(default)s)")
    _url(listing)
    listing.set_defaults(handler=schedule_list)

    change = actions.add_parser(
        "set", help="create or change a schedule (an unchanged one keeps its next run)"
    )
    change.add_argument("name", metavar="NAME")
    change.add_argument("--task", required=True, metavar="TASK", help="task name to enqueue")
    rhythm = change.add_mutually_exclusive_group(required=True)
    rhythm.add_argument("--cron", metavar="EXPR",
                        help="5 fields, or 6 with seconds first, e.g. '0 3 * * *'")
    rhythm.add_argument("--every", type=_number(float), metavar="SECONDS",
                        help="a fixed interval (at least 1 s)")
    change.add_argument("--timezone", default="UTC", metavar="ZONE",
                        help="IANA zone the cron expression is read in (default: UTC)")
    change.add_argument("--queue", metavar="QUEUE", help="(default: default)")
    change.add_argument("--task-version", type=_number(int), metavar="N", help="(default: 1)")
    change.add_argument("--payload", metavar="JSON", help="the tasks' payload (default: null)")
    change.add_argument("--priority", type=_number(int), default=0, metavar="N")
    change.add_argument("--max-attempts", type=_number(int), metavar="N")
    change.add_argument("--timeout", type=_number(float), metavar="SECONDS")
    change.add_argument("--misfire", choices=MISFIRE_POLICIES, default="latest",
                        help="what missed occurrences become (default: %(default)s)")
    change.add_argument("--catch-up-limit", type=_number(int), metavar="N",
                        help="most missed occurrences misfire=catch_up creates")
    change.add_argument("--overlap", choices=OVERLAP_POLICIES, default="allow",
                        help="skip: no new task while the previous one is unfinished")
    change.add_argument("--start-at", metavar="ISO_TIME",
                        help="first occurrence at or after this time (with its offset)")
    change.add_argument("--actor", metavar="WHO", help="recorded in the audit log")
    _url(change)
    change.set_defaults(handler=schedule_set)

    for name, text in (
        ("pause", "stop creating tasks (occurrences while paused are skipped)"),
        ("resume", "create tasks again, from the next occurrence"),
        ("run-now", "enqueue one occurrence now, from the schedule's template"),
        ("delete", "delete a schedule (its tasks are kept)"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("name", metavar="NAME")
        action.add_argument("--actor", metavar="WHO", help="recorded in the audit log")
        action.add_argument("--reason", metavar="TEXT", help="recorded in the audit log")
        _url(action)
        action.set_defaults(handler=_run_now if name == "run-now" else _change)
