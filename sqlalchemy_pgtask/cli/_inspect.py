"""The operator commands (``status``, ``task ...``, ``queue ...``): call the library and print
what it returns; never query or change tables themselves.

Reads go through the read models of `sqlalchemy_pgtask.status`; the two writes are the
library's own `cancel` and `configure_queue`, each in a transaction the command commits.
"""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy import Connection

from sqlalchemy_pgtask import TaskNotFound, cancel, configure_queue, list_queues, status
from sqlalchemy_pgtask.cli import _render
from sqlalchemy_pgtask.cli._connection import in_transaction
from sqlalchemy_pgtask.cli._errors import EXIT_OK
from sqlalchemy_pgtask.states import RUNNING

__all__ = [
    "queue_list",
    "queue_set",
    "show_status",
    "task_cancel",
    "task_list",
    "task_show",
]


def _print(lines: list[str]) -> None:
    for line in lines:
        print(line)


def show_status(args: argparse.Namespace) -> int:
    def read(connection: Connection) -> list[str]:
        return _render.status_lines(
            status.live_workers(connection),
            status.queue_status(connection),
            status.unroutable(connection),
        )

    _print(in_transaction(args, read, read_only=True))
    return EXIT_OK


def task_list(args: argparse.Namespace) -> int:
    filters: dict[str, Any] = {
        "state": args.state, "queue": args.queue, "name": args.name, "limit": args.limit,
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

    def run(connection: Connection) -> str:
        state = cancel(connection, task_id)
        if state is not None:
            if state == RUNNING:
                return f"task {task_id}: cancellation requested; its worker will stop it"
            return f"task {task_id}: {state}"
        # cancel() says None both for "no such task" and "already finished": look.
        found = status.task_summary(connection, task_id)
        if found is None:
            raise TaskNotFound(f"no task with id {task_id}")
        return f"task {task_id} had already finished: {found.state}"

    print(in_transaction(args, run, read_only=False))
    return EXIT_OK


def queue_set(args: argparse.Namespace) -> int:
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

    def run(connection: Connection) -> list[status.QueueSettings]:
        configure_queue(connection, args.name, **options)
        return [q for q in list_queues(connection) if q.name == args.name]

    _print([_render.queue_settings_line(q) for q in in_transaction(args, run, read_only=False)])
    return EXIT_OK


def queue_list(args: argparse.Namespace) -> int:
    queues = in_transaction(args, list_queues, read_only=True)
    if not queues:
        print("no queue has settings; every queue uses the defaults")
    _print([_render.queue_settings_line(q) for q in queues])
    return EXIT_OK
