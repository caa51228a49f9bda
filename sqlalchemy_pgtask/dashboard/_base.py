"""dashboard._base: what every page and action needs (`Dashboard`: database access, URLs and
rendering; `NotFound`), below `_pages` and `_actions`, which `_app` composes into routes.

Database work runs on a synchronous SQLAlchemy `Engine` in Starlette's thread pool: the
library's read models and admin functions are synchronous, and a dashboard's load is a few
operators, not a hot path. Pages read in a read-only ``REPEATABLE READ`` transaction (one
snapshot per page, and the server refuses any write); actions write in one transaction
through the library's own functions, which write the audit entry with the change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlencode

import jinja2
from markupsafe import Markup, escape
from sqlalchemy import Connection, Engine, func, select
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.dashboard._chart_cache import ChartCache
from sqlalchemy_pgtask.dashboard._live import (
    FRAGMENT_HEADER,
    FRAGMENT_VALUE,
    LIVE_INTERVAL,
    render_fragment,
    wants_fragment,
)
from sqlalchemy_pgtask.dashboard._queries import PAGE_SIZE_MAX
from sqlalchemy_pgtask.dashboard._security import CSRF_FIELD, Guard
from sqlalchemy_pgtask.errors import SchemaNotInstalled

__all__ = ["Dashboard", "NotFound"]

_T = TypeVar("_T")
_HERE: Final = Path(__file__).resolve().parent

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


# Stands for a task id in the task route's path (`Dashboard.url`); no id looks like it.
_ID_MARK: Final = "\x00task-id\x00"


class NotFound(Exception):
    """A page for something that does not exist (a task id that matches no task)."""


class Dashboard:
    """What every page and action needs: the engine, the access rules, the templates."""

    def __init__(
        self, engine: Engine, guard: Guard, *, page_size: int, scan_limit: int, title: str,
        live_interval: float = LIVE_INTERVAL,
    ) -> None:
        self.engine = engine
        self.guard = guard
        self.page_size = page_size
        self.scan_limit = scan_limit
        self.title = title
        #: Seconds between live refreshes of a page's region (`_live`); 0: off.
        self.live_interval = live_interval
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
        self._task_path: tuple[str, ...] | None = None
        #: The overview charts' closed buckets, kept between requests (`_chart_cache`).
        self.chart_cache = ChartCache()

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
                    select(func.set_config("statement_timeout", _READ_TIMEOUT_MS, True),
                           # A page's statements read index ranges in milliseconds; a rough
                           # estimate (a recursive CTE's) would have JIT compile one for
                           # 30 to 100 ms longer than it runs.
                           func.set_config("jit", "off", True))
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
        task_id = str(params.get("task_id", ""))
        if name == "task" and len(params) == 1 and task_id and "/" not in task_id:
            # A long workflow's page links a few hundred tasks: the route's path is resolved
            # once (Starlette walks every route per call) and the id put in its place.
            if self._task_path is None:
                self._task_path = tuple(
                    str(self.router.url_path_for(name, task_id=_ID_MARK)).split(_ID_MARK)
                )
            prefix, suffix = self._task_path
            return f"{root}{prefix}{task_id}{suffix}"
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
        """The page ``template`` with ``context`` and what every page shows; its live region
        alone when the request asks for it (`_live`)."""
        actor = self.guard.actor(request)
        values = {
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
            "live_interval": self.live_interval,
            **context,
        }
        page = self.templates.get_template(template)
        fragment = render_fragment(page, values) if wants_fragment(request) else None
        response = HTMLResponse(page.render(values) if fragment is None else fragment,
                                status_code=status_code)
        if fragment is not None:
            response.headers[FRAGMENT_HEADER] = FRAGMENT_VALUE
        # A cache keyed by the URL alone must not answer a page with a fragment, or back.
        response.headers["vary"] = FRAGMENT_HEADER
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
