"""dashboard._schedules: the schedules page and its admin actions (pause, resume); the page
reads in one read-only snapshot, each action goes through `_actions.act` (CSRF, then the
actor) to the library's schedule function, which writes the change and its audit entry in one
transaction.

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
from sqlalchemy import Connection
from starlette.requests import Request
from starlette.responses import Response

from sqlalchemy_pgtask.dashboard._actions import act
from sqlalchemy_pgtask.dashboard._base import Dashboard, NotFound
from sqlalchemy_pgtask.dashboard._pages import pretty
from sqlalchemy_pgtask.schedule import list_schedules, pause_schedule, resume_schedule
from sqlalchemy_pgtask.validation import check_task_name

__all__ = ["NOTICES", "schedule_action", "schedules", "zoned"]

#: Messages a schedule action's redirect may ask the page to show.
NOTICES: Final = {
    "schedule-paused": "The schedule is paused: its occurrences are skipped until it resumes.",
    "schedule-resumed": "The schedule is resumed from its next occurrence after now.",
}

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
        return {"schedules": list_schedules(connection, upcoming=5)}

    context = await dashboard.read(read)
    return dashboard.render(request, "schedules.html", {
        **context, "pretty": pretty, "zoned": zoned, "notice": _notice(request),
    })


async def schedule_action(dashboard: Dashboard, request: Request) -> Response:
    """``POST /schedules/{schedule}/{action}``: pause or resume one schedule."""
    name = check_task_name(request.path_params["schedule"], "name")
    action = request.path_params["action"]
    change = {"pause": pause_schedule, "resume": resume_schedule}.get(action)
    if change is None:
        raise NotFound(f"no schedule action {action[:40]!r}")

    def perform(connection: Connection, actor: str, reason: str | None) -> str:
        change(connection, name, actor=actor, reason=reason)
        return f"schedule-{action}d"

    return await act(dashboard, request, perform, dashboard.url(request, "schedules"))
