"""dashboard._pages: the read-only pages (overview, tasks, one task, workers, audit log;
schedules are `_schedules`'); each reads in one read-only snapshot and renders a template;
never writes.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Connection
from starlette.requests import Request
from starlette.responses import Response

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.dashboard._base import Dashboard, NotFound
from sqlalchemy_pgtask.dashboard._charts import WINDOWS, bars_svg, depth_svg, queue_charts
from sqlalchemy_pgtask.dashboard._payload import parse_payload_filter
from sqlalchemy_pgtask.dashboard._queries import (
    PAGE_SIZE_MAX,
    capabilities,
    running_tasks,
    task_tree,
    throughput,
)
from sqlalchemy_pgtask.dashboard._task_list import TaskFilters, task_page
from sqlalchemy_pgtask.dashboard._timeline import TIMELINE_LIMIT, timeline
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.explain.api import explain_knowing_latest_step
from sqlalchemy_pgtask.queues import list_queues
from sqlalchemy_pgtask.states import TASK_STATES

__all__ = ["audit", "overview", "parse_instant", "pretty", "task", "tasks", "workers"]

#: Messages an action's redirect may ask a page to show (never text from the URL itself).
NOTICES: Final = {
    "retried": "The task will run again.",
    "cancelled": "The task was cancelled.",
    "cancel-requested": "Cancellation was requested; its worker stops the handler soon.",
    "not-cancelled": "The task had already finished: nothing was changed.",
    "paused": "The queue is paused.",
    "resumed": "The queue is resumed.",
    "logged-in": "You are logged in: actions are enabled.",
    "logged-out": "You are logged out.",
}


#: The overview counts the tasks that finished within this span, not the whole history: a
#: count of every finished task reads all of them (about 0.3 s on 1,000,000).
FINISHED_SPAN: Final = timedelta(days=1)
#: The overview looks for work no worker can run among this many next tasks of each queue.
UNROUTABLE_PER_QUEUE: Final = 200


def _param(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value or None


def _instant(request: Request, name: str) -> datetime | None:
    return parse_instant(name, _param(request, name))


def parse_instant(name: str, raw: str | None) -> datetime | None:
    """A ``datetime-local`` field (or ISO 8601 text); without an offset it is UTC."""
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError as exc:
        raise InvalidOptionError(name, f"not a date and time: {raw[:40]!r}") from exc
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _is_number(raw: str) -> bool:
    # str.isdigit() also accepts digits int() refuses ("\u00b2", superscript two).
    return raw.isascii() and raw.isdigit()


def _limit(request: Request, default: int) -> int:
    raw = _param(request, "limit")
    if raw is None:
        return default
    if not _is_number(raw) or not 1 <= int(raw) <= PAGE_SIZE_MAX:
        raise InvalidOptionError("limit", f"must be 1 to {PAGE_SIZE_MAX}, got {raw[:20]!r}")
    return int(raw)


def pretty(value: Any) -> str:
    """JSON for people: indented, non-ASCII kept (the template escapes it)."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def _notice(request: Request) -> str | None:
    return NOTICES.get(request.query_params.get("notice", ""))


async def overview(dashboard: Dashboard, request: Request) -> Response:
    chart = _param(request, "chart") or next(iter(WINDOWS))
    if chart not in WINDOWS:
        raise InvalidOptionError(
            "chart", f"must be one of {', '.join(WINDOWS)}, got {chart[:20]!r}"
        )

    def read(connection: Connection) -> dict[str, Any]:
        queues = status.queue_status(connection, finished_since=FINISHED_SPAN)
        outstanding = {q.name: q.pending + q.running + q.waiting for q in queues}
        return {
            "queues": queues,
            "charts": queue_charts(
                connection, WINDOWS[chart], outstanding, dashboard.chart_cache
            ),
            "settings": {q.name: q for q in list_queues(connection)},
            "throughput": throughput(connection),
            "unroutable": status.unroutable(connection, per_queue=UNROUTABLE_PER_QUEUE),
            "workers": len(status.live_workers(connection)),
        }

    context = await dashboard.read(read)
    links = {name: dashboard.here(request, chart=name) for name in WINDOWS}
    return dashboard.render(request, "overview.html", {
        **context, "notice": _notice(request), "chart_links": links, "windows": WINDOWS,
        "bars_svg": bars_svg, "depth_svg": depth_svg, "unroutable_per_queue": UNROUTABLE_PER_QUEUE,
    })


async def tasks(dashboard: Dashboard, request: Request) -> Response:
    state = _param(request, "state")
    filters = TaskFilters(
        state=state,  # type: ignore[arg-type]  # checked by TaskFilters
        queue=_param(request, "queue"),
        name=_param(request, "name"),
        since=_instant(request, "since"),
        until=_instant(request, "until"),
        search=_param(request, "q"),
        payload=parse_payload_filter(_param(request, "payload")),
    )
    limit = _limit(request, dashboard.page_size)
    after = _param(request, "after")

    def read(connection: Connection) -> Any:
        return task_page(
            connection, filters, limit=limit, after=after, scan_limit=dashboard.scan_limit
        )

    page = await dashboard.read(read)
    next_url = None
    if page.next_cursor is not None:
        next_url = dashboard.here(request, after=page.next_cursor)
    first_url = dashboard.here(request, after=None) if after else None
    return dashboard.render(
        request,
        "tasks.html",
        {
            "page": page,
            "filters": filters,
            "form": {k: request.query_params.get(k, "") for k in (
                "state", "queue", "name", "since", "until", "q", "payload", "limit"
            )},
            "states": TASK_STATES,
            "next_url": next_url,
            "first_url": first_url,
            "scan_limit": dashboard.scan_limit,
        },
    )


async def task(dashboard: Dashboard, request: Request) -> Response:
    task_id = status.parse_task_id(request.path_params["task_id"])

    def read(connection: Connection) -> dict[str, Any] | None:
        detail = status.task_detail(
            connection, task_id, attempts_limit=TIMELINE_LIMIT, steps_limit=TIMELINE_LIMIT,
            children_limit=TIMELINE_LIMIT,
        )
        if detail is None:
            return None
        # The steps are the newest, oldest first, read in this snapshot: the last is the
        # checkpoint explain would read again (a second pass over all of a long workflow's).
        latest = detail.steps[-1] if detail.steps else None
        explanation = explain_knowing_latest_step(
            connection, task_id,
            None if latest is None else (latest.step, latest.kind, latest.value),
        )
        return {
            "task": detail,
            "tree": task_tree(connection, detail),
            "entries": list_audit(connection, task_id=task_id, limit=50),
            "explanation": explanation,
            "timeline": timeline(connection, detail, explanation.now),
        }

    context = await dashboard.read(read)
    if context is None:
        raise NotFound(f"no task with id {task_id}")
    return dashboard.render(
        request, "task.html", {**context, "pretty": pretty, "notice": _notice(request)}
    )


async def workers(dashboard: Dashboard, request: Request) -> Response:
    def read(connection: Connection) -> dict[str, Any]:
        live = status.live_workers(connection)
        ids = [w.id for w in live]
        running: dict[Any, list[Any]] = {}
        for item in running_tasks(connection, ids):
            running.setdefault(item.lease_owner, []).append(item)
        return {
            "workers": live,
            "capabilities": capabilities(connection, ids),
            "running": running,
        }

    return dashboard.render(request, "workers.html", await dashboard.read(read))


async def audit(dashboard: Dashboard, request: Request) -> Response:
    limit = _limit(request, dashboard.page_size)
    before = _param(request, "before")
    if before is not None and not _is_number(before):
        raise InvalidOptionError("before", f"not an entry id: {before[:20]!r}")
    queue, task_id = _param(request, "queue"), _param(request, "task")

    def read(connection: Connection) -> list[Any]:
        return list_audit(
            connection, queue=queue, task_id=task_id, limit=limit + 1,
            before_id=None if before is None else int(before),
        )

    entries = await dashboard.read(read)
    next_url = None
    if len(entries) > limit:
        entries = entries[:limit]
        next_url = dashboard.here(request, before=entries[-1].id)
    return dashboard.render(
        request,
        "audit.html",
        {
            "entries": entries,
            "next_url": next_url,
            "first_url": dashboard.here(request, before=None) if before else None,
            "form": {"queue": queue or "", "task": task_id or ""},
            "pretty": pretty,
        },
    )
