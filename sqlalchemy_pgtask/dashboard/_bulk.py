"""dashboard._bulk: retry or cancel every task of the task list's filtered selection, for an
admin, in two steps; the first only counts, the second writes, in one transaction, through
the library's own `retry` and `cancel` (one audit entry per task).

``POST /tasks/bulk/retry`` (or ``cancel``) with the task list's filters answers a page that
says how many tasks the action would change and repeats the exact filter; nothing is written.
Its form posts the same filters back with ``confirm``, and only then are the tasks changed.
The confirmation pins the selection to the tasks created before the count was taken, so a
task enqueued while the operator reads the page is never swept in; tasks whose state changed
in between are left out (only failed or cancelled tasks are retried, only unfinished ones
cancelled).

A selection is bounded: more than `BULK_MAX` tasks are refused with a message, at both steps,
so one click never holds thousands of row locks or writes thousands of audit entries. A
filter this module does not know (one a later task list adds) is refused too, rather than
silently ignored, which would widen the selection.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final
from urllib.parse import urlencode

from sqlalchemy import Connection, func, literal_column, select
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from sqlalchemy_pgtask.admin import retry as retry_task
from sqlalchemy_pgtask.audit import check_reason
from sqlalchemy_pgtask.client import cancel as cancel_task
from sqlalchemy_pgtask.dashboard._base import Dashboard, NotFound
from sqlalchemy_pgtask.dashboard._pages import parse_instant
from sqlalchemy_pgtask.dashboard._payload import contains, parse_payload_filter
from sqlalchemy_pgtask.dashboard._security import CSRF_FIELD
from sqlalchemy_pgtask.dashboard._task_list import TaskFilters, search_match
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import Task
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import ACTIVE_STATES, CANCELLED, FAILED, RUNNING

__all__ = ["BULK_MAX", "bulk"]

#: The most tasks one bulk action changes.
BULK_MAX: Final = 1000
#: The task list's filter fields (``q``: a task id or an idempotency key), as it sends them.
FILTER_FIELDS: Final = ("state", "queue", "name", "since", "until", "q", "payload")
_CONTROL_FIELDS: Final = frozenset({CSRF_FIELD, "as_of", "confirm", "reason", "limit", "after"})
#: The states each action applies to, and what the page calls the change.
_APPLIES: Final = {"retry": (FAILED, CANCELLED), "cancel": ACTIVE_STATES}
_PAST: Final = {"retry": "retried", "cancel": "cancelled"}
_LABELS: Final = {
    "state": "state", "queue": "queue", "name": "task name", "since": "created from",
    "until": "created before", "q": "id or idempotency key", "payload": "payload contains",
}
#: The longest the selection's statements may run (as long as a page's).
_TIMEOUT_MS: Final = "10000"


def _text(form: FormData, field: str) -> str | None:
    value = form.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidOptionError(field, "must be text")
    return value.strip() or None


def _filters(form: FormData) -> tuple[TaskFilters, dict[str, str]]:
    """The task list's filters in ``form``, checked, and their raw text (to post back)."""
    for field in form:
        if field not in FILTER_FIELDS and field not in _CONTROL_FIELDS and _text(form, field):
            raise InvalidOptionError(
                field, "is not a filter bulk actions know: narrow the list by state, queue, "
                "name, creation time, id or payload instead",
            )
    raw = {field: text for field in FILTER_FIELDS if (text := _text(form, field)) is not None}
    filters = TaskFilters(
        state=raw.get("state"),  # type: ignore[arg-type]  # checked by TaskFilters
        queue=raw.get("queue"), name=raw.get("name"),
        since=parse_instant("since", raw.get("since")),
        until=parse_instant("until", raw.get("until")),
        search=raw.get("q"), payload=parse_payload_filter(raw.get("payload")),
    )
    return filters, raw


def _conditions(filters: TaskFilters, action: str, as_of: datetime | None) -> list[Any]:
    """What selects the tasks ``action`` changes: the filters, the states it applies to and,
    once confirmed, creation before the count."""
    # Literals, not parameters: the planner can then match the partial index on unfinished
    # tasks (a cancel) or on finished ones (a retry), so the count never reads the history
    # of states the action cannot change. States are a fixed set of words, never user input.
    found: list[Any] = [
        Task.state.in_([literal_column(f"'{state}'") for state in _APPLIES[action]])
    ]
    if action == "cancel":  # asking again for a running task changes nothing
        found.append((Task.state != RUNNING) | Task.cancel_requested_at.is_(None))
    for column, value in (
        (Task.state, filters.state), (Task.queue, filters.queue), (Task.name, filters.name)
    ):
        if value is not None:
            found.append(column == value)
    if filters.since is not None:
        found.append(Task.created_at >= filters.since)
    if filters.until is not None:
        found.append(Task.created_at < filters.until)
    if as_of is not None:
        found.append(Task.created_at < as_of)
    if filters.search is not None:
        found.append(search_match(filters.search, filters.queue))
    if filters.payload is not None:
        found.append(contains(filters.payload))
    return found


def _bounded(connection: Connection) -> None:
    connection.execute(select(func.set_config("statement_timeout", _TIMEOUT_MS, True)))


def _count(connection: Connection, conditions: list[Any]) -> tuple[int, datetime]:
    """How many tasks match (``BULK_MAX + 1`` at most: reading more would only say "too
    many"), and database now, which the confirmation pins the selection to."""
    matching = select(Task.id).where(*conditions).limit(BULK_MAX + 1).subquery()
    row = connection.execute(
        select(select(func.count()).select_from(matching).scalar_subquery(), NOW)
    ).one()
    return int(row[0]), row[1]


def _apply(
    connection: Connection, action: str, conditions: list[Any], actor: str, reason: str | None
) -> dict[str, int] | None:
    """Lock the selection (by id, so two bulk actions cannot deadlock) and change each task;
    None if it grew past `BULK_MAX` (nothing written)."""
    _bounded(connection)
    ids: list[uuid.UUID] = list(connection.execute(
        select(Task.id).where(*conditions).order_by(Task.id).limit(BULK_MAX + 1)
        .with_for_update(of=Task)
    ).scalars())
    if len(ids) > BULK_MAX:
        return None
    counts = {"changed": 0, "requested": 0, "finished": 0}
    for task_id in ids:
        if action == "retry":
            retry_task(connection, task_id, actor=actor, reason=reason)
            counts["changed"] += 1
            continue
        # A child of a task cancelled earlier in the loop was cancelled with it (None).
        state = cancel_task(connection, task_id, actor=actor, reason=reason)
        counts[{"cancelled": "changed", "running": "requested"}.get(state or "", "finished")] += 1
    return counts


def _described(raw: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(_LABELS[field], raw[field]) for field in FILTER_FIELDS if field in raw]


async def bulk(dashboard: Dashboard, request: Request) -> Response:
    """``POST /tasks/bulk/{action}``: without ``confirm`` the count and the filter, with it
    the change."""
    action = request.path_params["action"]
    if action not in _APPLIES:
        raise NotFound(f"no bulk action {action[:40]!r}")
    form = await request.form(max_files=0, max_fields=20)
    if not dashboard.guard.csrf_valid(request, form.get(CSRF_FIELD)):
        return dashboard.error(
            request, 403, "The form's CSRF token is missing or wrong: reload the page and retry."
        )
    actor = dashboard.guard.actor(request)
    if actor is None:
        return dashboard.error(request, 403, "This action needs the admin token: log in first.")
    filters, raw = _filters(form)
    confirmed = _text(form, "confirm") == "yes"
    as_of = parse_instant("as_of", _text(form, "as_of")) if confirmed else None
    if confirmed and as_of is None:
        raise InvalidOptionError("as_of", "a confirmation needs the time of its count")
    conditions = _conditions(filters, action, as_of)
    context: dict[str, Any] = {
        "action": action, "past": _PAST[action], "states": _APPLIES[action],
        "described": _described(raw), "raw": raw, "bulk_max": BULK_MAX,
        "back": dashboard.url(request, "tasks") + (f"?{urlencode(raw)}" if raw else ""),
        "counts": None, "count": 0, "as_of": None, "too_many": False,
    }
    if confirmed:
        reason = check_reason(_text(form, "reason"))  # before any lock is taken
        counts = await dashboard.write(
            lambda connection: _apply(connection, action, conditions, actor, reason)
        )
        if counts is None:
            return _refused(dashboard, request, context)
        return dashboard.render(request, "bulk.html", {**context, "counts": counts})
    count, now = await dashboard.read(lambda connection: _count(connection, conditions))
    if count > BULK_MAX:
        return _refused(dashboard, request, context)
    return dashboard.render(
        request, "bulk.html", {**context, "count": count, "as_of": now.isoformat()}
    )


def _refused(dashboard: Dashboard, request: Request, context: dict[str, Any]) -> Response:
    return dashboard.render(request, "bulk.html", {**context, "too_many": True}, status_code=409)
