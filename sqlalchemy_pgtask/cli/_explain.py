"""``pgtask task explain``: print why a task is not running now, as `explain` says it; never
queries tables itself.

The text form is the `Explanation`'s summary (the task, then one line per reason); ``--json``
prints one document with the stable reason codes and their details, for scripts. It runs in
the read-only ``REPEATABLE READ`` transaction of every looking command, so its several reads
see one snapshot. An unknown task exits 1 with one line, like ``task show``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from sqlalchemy import Connection

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.cli._connection import in_transaction
from sqlalchemy_pgtask.cli._errors import EXIT_OK
from sqlalchemy_pgtask.cli._render import json_default, printable
from sqlalchemy_pgtask.explain import Explanation, explain

__all__ = ["add_command", "explanation_json", "task_explain"]


def explanation_json(explanation: Explanation) -> str:
    """``{"task_id", "queue", "name", "version", "state", "now", "codes", "reasons": [...]}``
    on one line; times in ISO 8601 with their offset, ids as strings."""
    document = {**dataclasses.asdict(explanation), "codes": list(explanation.codes)}
    return json.dumps(document, default=json_default, ensure_ascii=False)


def task_explain(args: argparse.Namespace) -> int:
    task_id = status.parse_task_id(args.task_id)

    def read(connection: Connection) -> Explanation:
        return explain(connection, task_id)

    explanation = in_transaction(args, read, read_only=True)
    text = explanation_json(explanation) if args.json else explanation.summary
    for line in text.splitlines():  # the task's error is user data: no raw control characters
        print(printable(line))
    return EXIT_OK


def add_command(actions: Any, url_option: Any) -> None:
    """The ``explain`` action of ``pgtask task``; ``url_option`` adds ``--database-url``."""
    command = actions.add_parser(
        "explain", help="say in plain words why a task is not running now",
        description=(
            "Why a task is not running now, from the database alone: not due yet, asleep, "
            "its queue paused or rate limited, no live worker with its handler version, "
            "every able worker busy, waiting for a signal or a child, running (on which "
            "worker, lease until when), or finished (and why). Exits 1 if there is no such "
            "task. See docs/explain.md."
        ),
    )
    command.add_argument("task_id", metavar="TASK_ID")
    command.add_argument(
        "--json", action="store_true",
        help="one JSON document (state, reason codes and their details) instead",
    )
    url_option(command)
    command.set_defaults(handler=task_explain)
