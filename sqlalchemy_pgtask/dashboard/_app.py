"""dashboard._app: builds the Starlette application: routes, the engine, the session age and
error pages; the pages and actions live in `_pages` and `_actions`, and what they share
(`Dashboard`, `NotFound`) in `_base`: they never import this module, which composes them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import psycopg
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from sqlalchemy_pgtask.dashboard import _actions, _bulk, _pages, _schedules
from sqlalchemy_pgtask.dashboard._asgi import DashboardApp
from sqlalchemy_pgtask.dashboard._base import Dashboard, NotFound
from sqlalchemy_pgtask.dashboard._live import LIVE_INTERVAL, check_live_interval
from sqlalchemy_pgtask.dashboard._queries import PAGE_SIZE_MAX
from sqlalchemy_pgtask.dashboard._security import (
    SESSION_MAX_AGE,
    SESSION_MAX_AGE_MAX,
    SESSION_MAX_AGE_MIN,
    ActorHook,
    Guard,
)
from sqlalchemy_pgtask.dashboard._task_list import SCAN_LIMIT
from sqlalchemy_pgtask.errors import (
    PgTaskError,
    QueueFull,
    SchemaNotInstalled,
    TaskNotFound,
    TaskNotRetryable,
    ValidationError,
)
from sqlalchemy_pgtask.schedule import ScheduleNotFound

__all__ = ["Dashboard", "NotFound", "create_app"]

_HERE: Final = Path(__file__).resolve().parent

#: HTTP status of each expected error; anything else is a bug and a 500.
_STATUS: Final[tuple[tuple[type[PgTaskError], int], ...]] = (
    (ValidationError, 400),
    (TaskNotFound, 404),
    (ScheduleNotFound, 404),
    (TaskNotRetryable, 409),
    (QueueFull, 409),
    (SchemaNotInstalled, 503),
)


#: Database errors a page or action may meet on purpose: the status and what the page says.
_DATABASE: Final[tuple[tuple[type[Exception], int, str], ...]] = (
    (psycopg.errors.QueryCanceled, 503,
     "The page's query ran longer than 10 s and was cancelled: narrow the filters "
     "(a queue, a time range)."),
    (psycopg.errors.InsufficientPrivilege, 403,
     "The dashboard's database role lacks a privilege this action needs (see docs/roles.md: "
     "actions need the admin level): nothing was changed."),
)


def _session_seconds(value: object) -> int:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"session_max_age must be seconds or a timedelta, got {value!r}")
    if not SESSION_MAX_AGE_MIN <= value <= SESSION_MAX_AGE_MAX:
        raise ValueError(
            f"session_max_age must be {SESSION_MAX_AGE_MIN} s to 400 days, got {value!r}"
        )
    return int(value)


def _engine(engine_or_url: Engine | str | URL) -> tuple[Engine, bool]:
    if isinstance(engine_or_url, Engine):
        return engine_or_url, False
    url = make_url(engine_or_url)
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"the dashboard needs PostgreSQL, got a {url.get_backend_name()!r} URL")
    url = url.set(drivername="postgresql+psycopg")
    return create_engine(url, pool_size=4, max_overflow=4, pool_pre_ping=True), True


def _wrap(
    dashboard: Dashboard, endpoint: Callable[[Dashboard, Request], Any]
) -> Callable[[Request], Any]:
    async def handle(request: Request) -> Response:
        try:
            response: Response = await endpoint(dashboard, request)
        except NotFound as exc:
            return dashboard.error(request, 404, str(exc))
        except DBAPIError as exc:
            for cause, code, message in _DATABASE:
                if isinstance(exc.orig, cause):
                    return dashboard.error(request, code, message)
            raise
        except PgTaskError as exc:
            for kind, code in _STATUS:
                if isinstance(exc, kind):
                    return dashboard.error(request, code, str(exc))
            raise
        return response

    return handle


def create_app(
    engine_or_url: Engine | str | URL,
    *,
    admin_token: str | None = None,
    actor_from_request: ActorHook | None = None,
    page_size: int = 50,
    scan_limit: int = SCAN_LIMIT,
    title: str = "pgtask",
    session_max_age: float | timedelta = SESSION_MAX_AGE,
    require_login: bool = False,
    live_interval: float = LIVE_INTERVAL,
) -> Starlette:
    """The dashboard as a Starlette (ASGI) application: serve it, or mount it in your own.

    :param engine_or_url: a SQLAlchemy `Engine` on the pgtask database (yours, kept open), or
        a PostgreSQL URL (the dashboard then owns a small pool, closed at shutdown).
    :param admin_token: with it, an operator who logs in with the token (or sends it as
        ``Authorization: Bearer``) may retry, cancel, pause and resume; recorded in the audit
        log as ``dashboard:<name>``. Without it (and without a hook) the dashboard is
        read-only.
    :param actor_from_request: your own auth when mounted: called with each request, it
        returns the actor to record (the request may act) or None (it may only look).
    :param page_size: rows per page of the task list and the audit log (1 to 500).
    :param scan_limit: the most tasks one page of a filtered task list reads before it shows
        what it found and offers to search older tasks (at least ``page_size``).
    :param title: shown in the page header and title.
    :param session_max_age: how long a login lasts (seconds or a `timedelta`; 60 s to 400
        days, default 12 hours): the session cookie is refused after it, and the browser
        drops it.
    :param require_login: serve nothing but the login page (and its static files) to a
        request that is not an admin's (token, session or hook): pages redirect to the login,
        other methods get 401. Without it anyone who can reach the dashboard reads every
        task's payload, headers, result and traceback.
    :param live_interval: seconds between live refreshes of the overview, the task list and
        a task's page (1 to 3600, default 5; 0 turns live refresh off): the page's script
        fetches its region again while the tab is visible (docs/dashboard.md, "Live refresh").
    :raises ValueError: a bad page size, scan limit, session age or live interval, a token
        shorter than 8 characters, a URL that is not PostgreSQL's, or ``require_login`` with
        neither a token nor a hook (nobody could ever log in).

    Every action is a POST with a CSRF token; see docs/dashboard.md.
    """
    if not 1 <= page_size <= PAGE_SIZE_MAX:
        raise ValueError(f"page_size must be 1 to {PAGE_SIZE_MAX}, got {page_size}")
    if scan_limit < page_size:
        raise ValueError(f"scan_limit must be at least page_size ({page_size}), got {scan_limit}")
    if admin_token is not None and len(admin_token) < 8:
        raise ValueError("admin_token must be at least 8 characters")
    if require_login and admin_token is None and actor_from_request is None:
        raise ValueError("require_login needs an admin_token or actor_from_request")
    max_age = _session_seconds(session_max_age)
    interval = check_live_interval(live_interval)
    engine, owned = _engine(engine_or_url)
    dashboard = Dashboard(
        engine, Guard(admin_token, actor_from_request, max_age), page_size=page_size,
        scan_limit=scan_limit, title=title, live_interval=interval,
    )

    def route(path: str, endpoint: Callable[[Dashboard, Request], Any], name: str,
              methods: tuple[str, ...] = ("GET",)) -> Route:
        return Route(path, _wrap(dashboard, endpoint), name=name, methods=list(methods))

    routes = [
        route("/", _pages.overview, "overview"),
        route("/tasks", _pages.tasks, "tasks"),
        route("/tasks/{task_id}", _pages.task, "task"),
        route("/workers", _pages.workers, "workers"),
        route("/schedules", _schedules.schedules, "schedules"),
        route("/audit", _pages.audit, "audit"),
        route("/login", _actions.login_form, "login"),
        route("/login", _actions.login, "login_submit", ("POST",)),
        route("/logout", _actions.logout, "logout", ("POST",)),
        route("/tasks/bulk/{action}", _bulk.bulk, "bulk", ("POST",)),
        route("/schedules/{schedule}/{action}", _schedules.schedule_action, "schedule_action",
              ("POST",)),
        route("/tasks/{task_id}/retry", _actions.retry, "retry", ("POST",)),
        route("/tasks/{task_id}/cancel", _actions.cancel, "cancel", ("POST",)),
        route("/queues/{queue}/pause", _actions.pause, "pause", ("POST",)),
        route("/queues/{queue}/resume", _actions.resume, "resume", ("POST",)),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owned:
                engine.dispose()

    app = DashboardApp(routes=routes, lifespan=lifespan)
    app.guard, app.require_login = dashboard.guard, require_login
    dashboard.router = app
    app.state.dashboard = dashboard
    return app
