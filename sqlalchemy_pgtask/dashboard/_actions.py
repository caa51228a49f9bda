"""dashboard._actions: the POST endpoints (log in and out, retry, cancel, pause, resume); each
checks the CSRF token, then the actor, and only then calls the library, whose function writes
the change and its audit entry in one transaction. A refused request writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Connection
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from sqlalchemy_pgtask.admin import pause_queue, resume_queue
from sqlalchemy_pgtask.admin import retry as retry_task
from sqlalchemy_pgtask.client import cancel as cancel_task
from sqlalchemy_pgtask.dashboard._base import Dashboard
from sqlalchemy_pgtask.dashboard._security import CSRF_FIELD, check_operator_name
from sqlalchemy_pgtask.dashboard._throttle import Throttled
from sqlalchemy_pgtask.status import parse_task_id
from sqlalchemy_pgtask.validation import check_queue_name

__all__ = ["act", "cancel", "login", "login_form", "logout", "pause", "resume", "retry"]


async def _form(dashboard: Dashboard, request: Request) -> FormData | Response:
    """The request's form if its CSRF token is right, else the 403 page."""
    form = await request.form(max_files=0, max_fields=10)
    if not dashboard.guard.csrf_valid(request, form.get(CSRF_FIELD)):
        return dashboard.error(
            request, 403, "The form's CSRF token is missing or wrong: reload the page and retry."
        )
    return form


def _reason(form: FormData) -> str | None:
    value = form.get("reason")
    return value.strip() or None if isinstance(value, str) else None


async def act(
    dashboard: Dashboard,
    request: Request,
    perform: Callable[[Connection, str, str | None], str],
    back: str,
) -> Response:
    """Check the form and the actor, run ``perform(connection, actor, reason)`` in one
    transaction, and send the browser ``back`` with the notice ``perform`` returns."""
    form = await _form(dashboard, request)
    if isinstance(form, Response):
        return form
    actor = dashboard.guard.actor(request)
    if actor is None:
        return dashboard.error(
            request, 403, "This action needs the admin token: log in first."
        )
    reason = _reason(form)
    notice = await dashboard.write(lambda connection: perform(connection, actor, reason))
    return RedirectResponse(f"{back}?notice={notice}", status_code=303)


async def retry(dashboard: Dashboard, request: Request) -> Response:
    task_id = parse_task_id(request.path_params["task_id"])

    def perform(connection: Connection, actor: str, reason: str | None) -> str:
        retry_task(connection, task_id, actor=actor, reason=reason)
        return "retried"

    return await act(dashboard, request, perform, dashboard.url(request, "task", task_id=task_id))


async def cancel(dashboard: Dashboard, request: Request) -> Response:
    task_id = parse_task_id(request.path_params["task_id"])

    def perform(connection: Connection, actor: str, reason: str | None) -> str:
        state = cancel_task(connection, task_id, actor=actor, reason=reason)
        if state == "cancelled":
            return "cancelled"
        return "cancel-requested" if state == "running" else "not-cancelled"

    return await act(dashboard, request, perform, dashboard.url(request, "task", task_id=task_id))


async def pause(dashboard: Dashboard, request: Request) -> Response:
    queue = check_queue_name(request.path_params["queue"])

    def perform(connection: Connection, actor: str, reason: str | None) -> str:
        pause_queue(connection, queue, actor=actor, reason=reason)
        return "paused"

    return await act(dashboard, request, perform, dashboard.url(request, "overview"))


async def resume(dashboard: Dashboard, request: Request) -> Response:
    queue = check_queue_name(request.path_params["queue"])

    def perform(connection: Connection, actor: str, reason: str | None) -> str:
        resume_queue(connection, queue, actor=actor, reason=reason)
        return "resumed"

    return await act(dashboard, request, perform, dashboard.url(request, "overview"))


async def login_form(dashboard: Dashboard, request: Request) -> Response:
    return dashboard.render(request, "login.html", {"failed": False})


async def login(dashboard: Dashboard, request: Request) -> Response:
    form = await _form(dashboard, request)
    if isinstance(form, Response):
        return form
    token, name = form.get("token"), form.get("name")
    name = name.strip() if isinstance(name, str) and name.strip() else "admin"
    if dashboard.guard.admin_token is None:  # nothing to log in with: not a guess either
        return dashboard.render(request, "login.html", {"failed": True}, status_code=403)
    try:
        right = dashboard.guard.guess(request, token)
    except Throttled as exc:
        page = dashboard.error(
            request, 429,
            f"Too many wrong tokens from your address: try again in {exc.retry_after} s.",
        )
        page.headers["retry-after"] = str(exc.retry_after)
        return page
    if not right:
        return dashboard.render(request, "login.html", {"failed": True}, status_code=403)
    if check_operator_name(name) is None:
        return dashboard.error(
            request, 400, "The name must be 1 to 64 letters, digits or . _ @ + -"
        )
    response = RedirectResponse(
        dashboard.url(request, "overview") + "?notice=logged-in", status_code=303
    )
    dashboard.guard.log_in(request, response, name)
    return response


async def logout(dashboard: Dashboard, request: Request) -> Response:
    form = await _form(dashboard, request)
    if isinstance(form, Response):
        return form
    response = RedirectResponse(
        dashboard.url(request, "overview") + "?notice=logged-out", status_code=303
    )
    dashboard.guard.log_out(request, response)
    return response
