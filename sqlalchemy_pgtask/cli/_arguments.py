"""The ``pgtask`` command line's grammar: every command, option, default and help text; parses,
never runs anything.

The worker's defaults are read from `WorkerOptions` itself, so ``pgtask worker`` and
``Worker(registry, url)`` cannot drift apart, and ``--help`` shows the values in force. A
mistake on the command line is reported like every other error: one line on stderr
(``pgtask: error: ...``) and exit code 2, not argparse's usage block.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Final, NoReturn, get_args

from sqlalchemy_pgtask._logging import LOG_FORMATS
from sqlalchemy_pgtask._version import __version__
from sqlalchemy_pgtask.cli import (
    _commands,
    _dashboard,
    _explain,
    _grants,
    _inspect,
    _retention,
    _schedules,
)
from sqlalchemy_pgtask.cli._connection import URL_ENV
from sqlalchemy_pgtask.cli._errors import EXIT_USAGE
from sqlalchemy_pgtask.cli._types import int_between as _int_between
from sqlalchemy_pgtask.cli._types import seconds as _seconds
from sqlalchemy_pgtask.states import TASK_STATES
from sqlalchemy_pgtask.status import LIST_LIMIT_MAX
from sqlalchemy_pgtask.worker import EventLoop, WorkerOptions

__all__ = ["build_parser"]

LOG_LEVELS: Final = ("debug", "info", "warning", "error")


class _Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line, like the command's other errors."""

    def error(self, message: str) -> NoReturn:
        print(f"pgtask: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def worker_default(name: str) -> Any:
    """The default of the `WorkerOptions` field ``name``."""
    for field in dataclasses.fields(WorkerOptions):
        if field.name == name:
            return field.default
    raise LookupError(f"WorkerOptions has no field {name!r}")


_POSITIVE: Final = _int_between(1, 2**31 - 1)
_NON_NEGATIVE: Final = _int_between(0, 2**63 - 1)


def _add_url_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help=f"PostgreSQL URL, e.g. postgresql://user@host/db (default: ${URL_ENV})",
    )


def _add_worker(commands: Any) -> None:
    worker = commands.add_parser(
        "worker",
        help="run a worker for the handlers of a registry",
        description=(
            "Claim and run tasks for the handlers registered in MODULE:ATTRIBUTE. SIGTERM or "
            "SIGINT stops claiming and lets running handlers finish within the grace period; "
            "a second signal hands their tasks back at once. Defaults are WorkerOptions'."
        ),
    )
    worker.add_argument("registry", metavar="MODULE:ATTRIBUTE", help="e.g. app.tasks:registry")
    _add_url_option(worker)
    worker.add_argument(
        "--queue", action="append", metavar="QUEUE",
        help="a queue to serve; repeat for several, earlier first (default: all registered)",
    )
    worker.add_argument(
        "--concurrency", type=_POSITIVE, metavar="N", default=worker_default("concurrency"),
        help="handlers running at once (default: %(default)s)",
    )
    worker.add_argument(
        "--prefetch", type=_int_between(0, 100_000), metavar="N",
        default=worker_default("prefetch"),
        help="most tasks claimed ahead of free slots while handlers finish fast; 0 claims "
        "only for free slots (default: %(default)s)",
    )
    worker.add_argument(
        "--lease-duration", type=_seconds, metavar="SECONDS",
        default=worker_default("lease_duration"),
        help="lease length, renewed every third of it (default: %(default)s)",
    )
    worker.add_argument(
        "--shutdown-grace", type=_seconds, metavar="SECONDS",
        default=worker_default("shutdown_grace"),
        help="time running handlers get to finish after a shutdown signal "
        "(default: %(default)s)",
    )
    worker.add_argument(
        "--poll-interval", type=_seconds, metavar="SECONDS",
        default=worker_default("poll_interval"),
        help="longest idle sleep without a notification (default: %(default)s)",
    )
    worker.add_argument(
        "--no-instant-rescue", dest="instant_rescue", action="store_false",
        help="hold no advisory lock and rescue no dead worker's tasks early: leases alone "
        "recover them (for transaction-pooling proxies, where session locks say nothing)",
    )
    worker.add_argument(
        "--loop", default="auto", choices=get_args(EventLoop),
        help="event loop: auto is uvloop when installed (the uvloop extra), else asyncio "
        "(default: %(default)s)",
    )
    worker.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)"
    )
    worker.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS,
        help="text lines, or one JSON object per line with the task's fields "
        "(default: %(default)s)",
    )
    worker.add_argument(
        "--metrics-port", type=_int_between(0, 65_535), metavar="PORT",
        help="serve Prometheus metrics (/metrics) and probes (/healthz, /readyz) on this "
        "port; 0 picks a free one (needs the metrics extra; default: no server)",
    )
    worker.add_argument(
        "--metrics-host", metavar="HOST", default=worker_default("metrics_host"),
        help="address the metrics server listens on (default: %(default)s)",
    )
    worker.add_argument(
        "--metrics-interval", type=_seconds, metavar="SECONDS",
        default=worker_default("metrics_interval"),
        help="seconds between samples of the queues' backlog (default: %(default)s)",
    )
    worker.add_argument(
        "--health-timeout", type=_seconds, metavar="SECONDS",
        help="/healthz answers 503 after this long without a round trip to PostgreSQL "
        "(default: the lease duration)",
    )
    worker.add_argument(
        "--on-stuck-handler", choices=("warn", "exit"),
        default=worker_default("on_stuck_handler"),
        help="a def handler still running after its stop request when its lease can expire: "
        "log it, or exit with status 75 so no second run overlaps it (default: %(default)s)",
    )
    worker.set_defaults(handler=_commands.worker)


def _add_task(commands: Any) -> None:
    task = commands.add_parser("task", help="list, inspect, cancel or retry tasks")
    actions = task.add_subparsers(dest="task_command", metavar="ACTION", required=True)

    listing = actions.add_parser(
        "list", help="the newest tasks, one line each",
        description="Tasks newest first (by creation time), filtered by state, queue and name.",
    )
    listing.add_argument("--state", choices=TASK_STATES, help="only tasks in this state")
    listing.add_argument("--queue", metavar="QUEUE", help="only tasks of this queue")
    listing.add_argument("--name", metavar="NAME", help="only tasks with this task name")
    listing.add_argument("--key", metavar="KEY", help="only tasks with this concurrency key")
    listing.add_argument(
        "--limit", type=_int_between(1, LIST_LIMIT_MAX), default=50, metavar="N",
        help="at most N tasks (default: %(default)s)",
    )
    listing.add_argument(
        "--before", metavar="TASK_ID", help="only tasks older than this one (the next page)"
    )
    _add_url_option(listing)
    listing.set_defaults(handler=_inspect.task_list)

    show = actions.add_parser(
        "show", help="print a task, its attempts, steps, wait, parent and children"
    )
    show.add_argument("task_id", metavar="TASK_ID")
    show.add_argument(
        "--json", action="store_true",
        help="one JSON document (task, attempts, steps, wait, parent, children) instead",
    )
    _add_url_option(show)
    show.set_defaults(handler=_inspect.task_show)
    _explain.add_command(actions, _add_url_option)

    cancel = actions.add_parser(
        "cancel", help="cancel a task (audited)",
        description=(
            "Cancel a pending or waiting task at once, or ask a running task's worker to stop "
            "it. A change is recorded in the audit log with the actor and reason."
        ),
    )
    cancel.add_argument("task_id", metavar="TASK_ID")
    _inspect.add_audit_options(cancel)
    _add_url_option(cancel)
    cancel.set_defaults(handler=_inspect.task_cancel)

    retry = actions.add_parser(
        "retry", help="run a failed or cancelled task again (audited)",
        description=(
            "Make a failed or cancelled task pending again, due now, with a fresh budget of "
            "failed attempts; its attempts stay in its history and a durable task replays its "
            "checkpoints. Exits 1 if the task does not exist, is not failed or cancelled, or "
            "its queue is at capacity; nothing is written then."
        ),
    )
    retry.add_argument("task_id", metavar="TASK_ID")
    _inspect.add_audit_options(retry)
    _add_url_option(retry)
    retry.set_defaults(handler=_inspect.task_retry)


def _add_queue(commands: Any) -> None:
    queue = commands.add_parser("queue", help="list, pause, resume or change queues")
    actions = queue.add_subparsers(dest="queue_command", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="queues with settings")
    _add_url_option(listing)
    listing.set_defaults(handler=_inspect.queue_list)

    change = actions.add_parser(
        "set", help="create or change a queue's settings (only the options given change)",
        description="Changes are recorded in the audit log with the actor and reason.",
    )
    change.add_argument("name", metavar="QUEUE")
    capacity = change.add_mutually_exclusive_group()
    capacity.add_argument(
        "--capacity", type=_int_between(1, 2**63 - 1), metavar="N",
        help="most pending + running + waiting tasks",
    )
    capacity.add_argument("--no-capacity", action="store_true", help="remove the limit")
    pause = change.add_mutually_exclusive_group()
    pause.add_argument("--pause", dest="paused", action="store_const", const=True,
                       help="stop claims (enqueues still accepted)")
    pause.add_argument("--resume", dest="paused", action="store_const", const=False)
    change.add_argument("--terminal-retention", type=_NON_NEGATIVE, metavar="SECONDS")
    change.add_argument("--idempotency-retention", type=_NON_NEGATIVE, metavar="SECONDS")
    rate = change.add_mutually_exclusive_group()
    rate.add_argument(
        "--rate-limit", type=_inspect.rate_argument, metavar="N/PERIOD",
        help="most task starts per period across all workers: N/s, N/m, N/h, N/d, "
        "N/<seconds>s such as 100/30s, or N with --rate-period",
    )
    rate.add_argument("--no-rate-limit", action="store_true", help="remove the rate limit")
    change.add_argument(
        "--rate-period", type=_inspect.positive_seconds_argument, metavar="SECONDS",
        help="the period of a bare --rate-limit N (default: 1 second)",
    )
    starvation = change.add_mutually_exclusive_group()
    starvation.add_argument(
        "--starvation-timeout", type=_inspect.positive_seconds_argument, metavar="SECONDS",
        help="a pending task due for longer than this is claimed ahead of higher priorities",
    )
    starvation.add_argument(
        "--no-starvation-timeout", action="store_true", help="remove the starvation timeout"
    )
    _inspect.add_audit_options(change)
    _add_url_option(change)
    change.set_defaults(handler=_inspect.queue_set, paused=None)

    for action, verb, handler in (
        ("pause", "stop claims from a queue; enqueues are still accepted", _inspect.queue_pause),
        ("resume", "let workers claim from a paused queue again", _inspect.queue_resume),
    ):
        command = actions.add_parser(
            action, help=f"{verb} (audited)",
            description=f"{verb[0].upper()}{verb[1:]}. Recorded in the audit log.",
        )
        command.add_argument("name", metavar="QUEUE")
        _inspect.add_audit_options(command)
        _add_url_option(command)
        command.set_defaults(handler=handler)


def _add_audit(commands: Any) -> None:
    audit = commands.add_parser(
        "audit", help="administrative actions, newest first",
        description=(
            "Entries of the append-only audit log (retries, cancellations, queue and schedule "
            "changes), newest first, filtered by task, queue and schedule."
        ),
    )
    audit.add_argument("--task", metavar="TASK_ID", help="only entries about this task")
    audit.add_argument("--queue", metavar="QUEUE", help="only entries about this queue")
    audit.add_argument("--schedule", metavar="NAME", help="only entries about this schedule")
    audit.add_argument(
        "--limit", type=_int_between(1, _inspect.AUDIT_LIMIT_MAX), default=50, metavar="N",
        help="at most N entries (default: %(default)s)",
    )
    audit.add_argument(
        "--before", type=_int_between(1, 2**63 - 1), metavar="ID",
        help="only entries older than this id (the next page)",
    )
    audit.add_argument(
        "--json", action="store_true", help="one JSON array of the entries instead"
    )
    _add_url_option(audit)
    audit.set_defaults(handler=_inspect.audit_list)


def build_parser() -> argparse.ArgumentParser:
    """The ``pgtask`` parser; each command's namespace has a ``handler(args) -> exit code``."""
    parser = _Parser(prog="pgtask", description="Durable tasks and workflows inside PostgreSQL.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    migrate = commands.add_parser(
        "migrate",
        help="install or upgrade the pgtask schema (without an Alembic environment)",
        description=(
            "Apply pgtask's Alembic revisions. Records the applied revision in "
            "pgtask.alembic_version. If your application has its own Alembic environment, "
            "use `alembic upgrade heads` there instead (see docs/alembic.md)."
        ),
    )
    _add_url_option(migrate)
    migrate.add_argument(
        "--revision", default="pgtask@head", help="target revision (default: %(default)s)"
    )
    migrate.set_defaults(handler=_commands.migrate)

    init = commands.add_parser(
        "init-alembic",
        help="create an Alembic environment that includes pgtask's revisions",
        description=(
            "Create a new Alembic environment in DIRECTORY whose version_locations include "
            "pgtask's revisions and whose autogenerate ignores nothing it should compare."
        ),
    )
    init.add_argument("directory", help="the new environment's directory (absent or empty)")
    init.add_argument(
        "--config", default="alembic.ini", help="path of the alembic.ini to write"
    )
    init.set_defaults(handler=_commands.init_alembic)

    _add_worker(commands)

    status = commands.add_parser(
        "status", help="live workers, every queue's tasks by state, and work no worker can run"
    )
    _add_url_option(status)
    status.set_defaults(handler=_inspect.show_status)

    _add_task(commands)
    _add_queue(commands)
    _add_audit(commands)
    _schedules.add_commands(commands)
    _retention.add_commands(commands)
    _dashboard.add_commands(commands)
    _grants.add_commands(commands)

    demo = commands.add_parser(
        "demo",
        help="enqueue in a real transaction and run a worker, on an embedded PostgreSQL",
        description=(
            "Uses $PGTASK_DATABASE_URL if set (a throwaway database is created there and "
            "dropped), else starts an embedded PostgreSQL."
        ),
    )
    demo.add_argument(
        "--timeout", type=_seconds, default=60.0, help="seconds to wait (default: %(default)s)"
    )
    demo.set_defaults(handler=_commands.demo)
    return parser
