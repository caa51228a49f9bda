"""dashboard._schedules: the schedules page and its admin actions (pause, resume, run now);
the page reads in one read-only snapshot, each action goes through `_actions.act` (CSRF, then
the actor) to the library's schedule function, which writes the change and its audit entry in
one transaction.

A schedule's occurrences are instants of its own time zone (``0 3 * * *`` in Europe/Berlin
is 03:00 there, whatever the server's zone), so the page shows every time in that zone and
says which one it is, with UTC beside it; times that belong to no zone (paused, changed) are
shown in UTC, labelled so.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from markupsafe import Markup, escape
from sqlalchemy import Connection, func, select
from sqlalchemy.exc import DBAPIError
from starlette.requests import Request
from starlette.responses import Response

from sqlalchemy_pgtask.dashboard._actions import act
from sqlalchemy_pgtask.dashboard._base import Dashboard, NotFound
from sqlalchemy_pgtask.dashboard._pages import pretty
from sqlalchemy_pgtask.schedule import (
    list_schedules,
    pause_schedule,
    resume_schedule,
    run_schedule_now,
)
from sqlalchemy_pgtask.validation import check_task_name

__all__ = ["NOTICES", "schedule_action", "schedules", "zoned"]

#: Messages a schedule action's redirect may ask the page to show.
NOTICES: Final = {
    "schedule-paused": "The schedule is paused: its occurrences are skipped until it resumes.",
    "schedule-resumed": "The schedule is resumed from its next occurrence after now.",
    "schedule-run": "One occurrence was enqueued now; it is the schedule's last task.",
}
#: insufficient_privilege: run now inserts a task, which the admin level may not.
_NO_PRIVILEGE: Final = "42501"
_CANNOT_ENQUEUE: Final = (
    "Run now enqueues a task, and the dashboard's database role may not insert into "
    "pgtask.tasks (the admin level of `pgtask grants` cannot enqueue): give that role the "
    "producer level too, or run `pgtask schedule run-now NAME` as a role that can. "
    "Nothing was changed."
)

_STAMP: Final = "%Y-%m-%d %H:%M:%S"


def zoned(value: datetime | None, zone: str = "UTC") -> Markup:
    """``value`` as a ``<time>`` in ``zone``, the zone's name after it and the UTC instant in
    its title (a zone this Python cannot load falls back to UTC, labelled so)."""
    if value is None:
        return Markup('<span class="muted">&ndash;</span>')
    try:
        local = value.astimezone(ZoneInfo(zone))
    except (ZoneInfoNotFoundError, ValueError):
        local, zone = value.astimezone(timezone.utc), "UTC"
    utc = value.astimezone(timezone.utc)
    label = escape(f"{local.strftime(_STAMP)} {zone}")
    title = "" if zone == "UTC" else f' title="{utc.strftime(_STAMP)} UTC"'
    return Markup(  # noqa: S704  # the label is escaped, the rest are digits
        f'<time datetime="{utc.isoformat()}"{title}>{label}</time>'
    )


def _notice(request: Request) -> str | None:
    return NOTICES.get(request.query_params.get("notice", ""))


async def schedules(dashboard: Dashboard, request: Request) -> Response:
    def read(connection: Connection) -> dict[str, Any]:
        may_enqueue = connection.execute(select(
            func.has_any_column_privilege("pgtask.tasks", "INSERT")
        )).scalar_one()
        return {"schedules": list_schedules(connection, upcoming=5), "may_enqueue": may_enqueue}

    context = await dashboard.read(read)
    return dashboard.render(request, "schedules.html", {
        **context, "pretty": pretty, "zoned": zoned, "notice": _notice(request),
    })


async def schedule_action(dashboard: Dashboard, request: Request) -> Response:
    """``POST /schedules/{schedule}/{action}``: pause, resume or run now one schedule; a
    role that may not enqueue gets 403 with the reason, not an error page."""
    name = check_task_name(request.path_params["schedule"], "name")
    action = request.path_params["action"]
    change = {
        "pause": pause_schedule, "resume": resume_schedule, "run-now": run_schedule_now,
    }.get(action)
    if change is None:
        raise NotFound(f"no schedule action {action[:40]!r}")

    def perform(connection: Connection, actor: str, reason: str | None) -> str:
        change(connection, name, actor=actor, reason=reason)
        return "schedule-run" if action == "run-now" else f"schedule-{action}d"

    try:
        return await act(dashboard, request, perform, dashboard.url(request, "schedules"))
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != _NO_PRIVILEGE or action != "run-now":
            raise
        return dashboard.error(request, 403, _CANNOT_ENQUEUE)
