"""dashboard._app: builds the Starlette application: routes, templates, database access and
error pages; the pages and actions themselves live in `_pages` and `_actions`.

Database work runs on a synchronous SQLAlchemy `Engine` in Starlette's thread pool: the
library's read models and admin functions are synchronous, and a dashboard's load is a few
operators, not a hot path. Pages read in a read-only ``REPEATABLE READ`` transaction (one
snapshot per page, and the server refuses any write); actions write in one transaction
through the library's own functions, which write the audit entry with the change.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlencode

import jinja2
import psycopg
from markupsafe import Markup, escape
from sqlalchemy import Connection, Engine, create_engine, func, make_url, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.dashboard._asgi import DashboardApp
from sqlalchemy_pgtask.dashboard._queries import PAGE_SIZE_MAX
from sqlalchemy_pgtask.dashboard._security import (
    CSRF_FIELD,
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

__all__ = ["Dashboard", "create_app"]

_T = TypeVar("_T")
_HERE: Final = Path(__file__).resolve().parent

#: HTTP status of each expected error; anything else is a bug and a 500.
_STATUS: Final[tuple[tuple[type[PgTaskError], int], ...]] = (
    (ValidationError, 400),
    (TaskNotFound, 404),
    (TaskNotRetryable, 409),
    (QueueFull, 409),
    (SchemaNotInstalled, 503),
)


def _when(value: datetime | None) -> Markup:
    """A timestamp as a ``<time>`` element; a dash for None (a filter: cheaper than a macro
    on the task list's every row). A datetime's ISO text holds no markup characters."""
    if value is None:
        return Markup('<span class="muted">&ndash;</span>')
    stamp = value.strftime("%Y-%m-%d %H:%M:%S")
    return Markup(f'<time datetime="{value.isoformat()}">{stamp}</time>')  # noqa: S704


def _state(value: str) -> Markup:
    """A state as a badge (escaped, though states are a fixed set of words)."""
    text = escape(value)
    return Markup(f'<span class="state state-{text}">{text}</span>')  # noqa: S704


#: The longest a page's statement may run before PostgreSQL cancels it.
_READ_TIMEOUT_MS: Final = "10000"


class NotFound(Exception):
    """A page for something that does not exist (a task id that matches no task)."""


class Dashboard:
    """What every page and action needs: the engine, the access rules, the templates."""

    def __init__(
        self, engine: Engine, guard: Guard, *, page_size: int, scan_limit: int, title: str
    ) -> None:
        self.engine = engine
        self.guard = guard
        self.page_size = page_size
        self.scan_limit = scan_limit
        self.title = title
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_HERE / "templates"),
            # Payloads, errors and names are user data: every value is escaped unless a
            # template says otherwise, and none does.
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.filters["when"] = _when
        self.templates.filters["state"] = _state
        self.router: Starlette | None = None

    # -- database -----------------------------------------------------------------------

    def _read(self, action: Callable[[Connection], _T]) -> _T:
        with self.engine.connect() as connection:
            connection.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
            try:
                # A filter that matches almost nothing walks a whole index: bound what one
                # page may cost the database (local to this transaction).
                connection.execute(
                    select(func.set_config("statement_timeout", _READ_TIMEOUT_MS, True))
                )
                if not status.schema_installed(connection):
                    raise SchemaNotInstalled()
                return action(connection)
            finally:
                connection.rollback()

    def _write(self, action: Callable[[Connection], _T]) -> _T:
        with self.engine.connect() as connection:
            if not status.schema_installed(connection):
                raise SchemaNotInstalled()
            result = action(connection)
            connection.commit()
            return result

    async def read(self, action: Callable[[Connection], _T]) -> _T:
        """Run ``action`` in a read-only snapshot, off the event loop."""
        return await run_in_threadpool(self._read, action)

    async def write(self, action: Callable[[Connection], _T]) -> _T:
        """Run ``action`` in one transaction that commits if it returns, off the event loop."""
        return await run_in_threadpool(self._write, action)

    # -- responses ----------------------------------------------------------------------

    def url(self, request: Request, name: str, /, **params: Any) -> str:
        """The path of the dashboard's route ``name``, under the prefix it is mounted at.

        ``request.url_for`` would resolve ``name`` against the outermost application's
        routes, where a mounted dashboard's routes carry the host's mount name.
        """
        assert self.router is not None
        root = str(request.scope.get("root_path") or "").rstrip("/")
        return root + str(self.router.url_path_for(name, **params))

    @staticmethod
    def here(request: Request, **changes: object) -> str:
        """This page's path and query with ``changes`` (None removes a parameter): a
        relative URL, never the request's host, which the client chose."""
        params = [(key, value) for key, value in request.query_params.multi_items()
                  if key not in changes]
        params += [(key, str(value)) for key, value in changes.items() if value is not None]
        query = urlencode(params)
        return request.url.path + (f"?{query}" if query else "")

    def render(
        self,
        request: Request,
        template: str,
        context: Mapping[str, Any],
        *,
        status_code: int = 200,
    ) -> HTMLResponse:
        """The page ``template`` with ``context`` and what every page shows."""
        actor = self.guard.actor(request)
        page = self.templates.get_template(template).render(
            {
                "request": request,
                "title": self.title,
                "url": lambda name, **params: self.url(request, name, **params),
                "actor": actor,
                "can_act": actor is not None,
                "actions_possible": self.guard.actions_possible,
                "token_login": self.guard.admin_token is not None,
                "csrf_field": CSRF_FIELD,
                "csrf_token": self.guard.csrf_token(request),
                "page_size_max": PAGE_SIZE_MAX,
                **context,
            }
        )
        response = HTMLResponse(page, status_code=status_code)
        self.guard.set_csrf_cookie(request, response)
        # The security headers are every response's (`_asgi`); a page is not to be cached.
        response.headers["cache-control"] = "no-store"
        return response

    def error(self, request: Request, status_code: int, message: str) -> HTMLResponse:
        """An error page saying ``message``."""
        return self.render(
            request, "error.html", {"status_code": status_code, "message": message},
            status_code=status_code,
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
        except OperationalError as exc:
            if not isinstance(exc.orig, psycopg.errors.QueryCanceled):
                raise
            return dashboard.error(
                request, 503,
                "The page's query ran longer than 10 s and was cancelled: narrow the filters "
                "(a queue, a time range).",
            )
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
    :raises ValueError: a bad page size, scan limit or session age, a token shorter than 8
        characters, a URL that is not PostgreSQL's, or ``require_login`` with neither a
        token nor a hook (nobody could ever log in).

    Every action is a POST with a CSRF token; see docs/dashboard.md.
    """
    from sqlalchemy_pgtask.dashboard import _actions, _pages

    if not 1 <= page_size <= PAGE_SIZE_MAX:
        raise ValueError(f"page_size must be 1 to {PAGE_SIZE_MAX}, got {page_size}")
    if scan_limit < page_size:
        raise ValueError(f"scan_limit must be at least page_size ({page_size}), got {scan_limit}")
    if admin_token is not None and len(admin_token) < 8:
        raise ValueError("admin_token must be at least 8 characters")
    if require_login and admin_token is None and actor_from_request is None:
        raise ValueError("require_login needs an admin_token or actor_from_request")
    max_age = _session_seconds(session_max_age)
    engine, owned = _engine(engine_or_url)
    dashboard = Dashboard(
        engine, Guard(admin_token, actor_from_request, max_age), page_size=page_size,
        scan_limit=scan_limit, title=title,
    )

    def route(path: str, endpoint: Callable[[Dashboard, Request], Any], name: str,
              methods: tuple[str, ...] = ("GET",)) -> Route:
        return Route(path, _wrap(dashboard, endpoint), name=name, methods=list(methods))

    routes = [
        route("/", _pages.overview, "overview"),
        route("/tasks", _pages.tasks, "tasks"),
        route("/tasks/{task_id}", _pages.task, "task"),
        route("/workers", _pages.workers, "workers"),
        route("/schedules", _pages.schedules, "schedules"),
        route("/audit", _pages.audit, "audit"),
        route("/login", _actions.login_form, "login"),
        route("/login", _actions.login, "login_submit", ("POST",)),
        route("/logout", _actions.logout, "logout", ("POST",)),
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
