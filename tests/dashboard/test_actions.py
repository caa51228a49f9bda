"""The dashboard's actions: POST only, CSRF-checked, allowed only with the admin token (or
the host application's hook), each written to the audit log by the library with its actor;
every refused request writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.cli import main
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.queues import list_queues
from sqlalchemy_pgtask.status import task_summary
from tests.dashboard.conftest import TOKEN, snapshot
from tests.dashboard.seed import Seeded

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf(client: TestClient, path: str = "/") -> str:
    """The CSRF token of the client's cookie, which any page sets (and its forms repeat)."""
    page = client.get(path)
    token = client.cookies.get("pgtask_csrf")
    assert token is not None
    for found in CSRF.findall(page.text):
        assert found == token
    return token


def log_in(client: TestClient, name: str = "carol") -> None:
    answer = client.post(
        "/login", data={"csrf_token": csrf(client, "/login"), "token": TOKEN, "name": name}
    )
    assert answer.status_code == 303


def state_of(engine: Engine, task_id: object) -> str:
    with engine.connect() as connection:
        summary = task_summary(connection, str(task_id))
    assert summary is not None
    return summary.state


def test_every_action_without_the_token_is_refused_and_writes_nothing(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    before = snapshot(pgtask_engine)
    actions = [
        f"/tasks/{seeded.failed}/retry", f"/tasks/{seeded.pending}/cancel",
        "/queues/emails/pause", "/queues/reports/resume",
    ]
    read_only, guarded = client_for(), client_for(admin_token=TOKEN)
    wrong_bearer = {"authorization": "Bearer not-the-token-at-all"}

    answers = [
        client.post(path, data={"csrf_token": csrf(client)}, headers=headers)
        for client, headers in ((read_only, {}), (guarded, {}), (guarded, wrong_bearer))
        for path in actions
    ]

    assert [a.status_code for a in answers] == [403] * len(answers)
    assert all("needs the admin token" in a.text for a in answers)
    assert snapshot(pgtask_engine) == before
    assert state_of(pgtask_engine, seeded.failed) == "failed"


def test_missing_or_wrong_csrf_token_is_refused_even_when_logged_in(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    log_in(client)
    before = snapshot(pgtask_engine)
    retry = f"/tasks/{seeded.failed}/retry"

    answers = [
        client.post(retry, data={}),
        client.post(retry, data={"csrf_token": "x" * 43}),
    ]
    token = csrf(client)
    client.cookies.delete("pgtask_csrf")
    answers.append(client.post(retry, data={"csrf_token": token}))

    assert [a.status_code for a in answers] == [403, 403, 403]
    assert all("CSRF" in a.text for a in answers)
    assert snapshot(pgtask_engine) == before


def test_actions_are_post_only(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    log_in(client)
    before = snapshot(pgtask_engine)

    answer = client.get(f"/tasks/{seeded.failed}/retry")

    assert answer.status_code == 405
    assert snapshot(pgtask_engine) == before


def test_login_sets_a_strict_httponly_cookie_and_a_wrong_token_sets_none(
    client_for: Callable[..., TestClient], seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    wrong = client.post(
        "/login", data={"csrf_token": csrf(client, "/login"), "token": "guess-guess"}
    )
    assert wrong.status_code == 403
    assert "pgtask_session" not in wrong.headers.get("set-cookie", "")

    right = client.post(
        "/login", data={"csrf_token": csrf(client, "/login"), "token": TOKEN, "name": "carol"}
    )

    cookie = right.headers["set-cookie"]
    assert right.status_code == 303
    assert "pgtask_session=" in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "samesite=strict" in cookie.lower()
    assert "dashboard:carol" in client.get("/").text


def test_retry_cancel_pause_resume_with_the_token_are_audited_with_the_actor(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    log_in(client, "carol")
    token = csrf(client)

    retried = client.post(f"/tasks/{seeded.failed}/retry",
                          data={"csrf_token": token, "reason": "smtp is back"})
    cancelled = client.post(f"/tasks/{seeded.pending}/cancel", data={"csrf_token": token})
    paused = client.post("/queues/emails/pause", data={"csrf_token": token})
    resumed = client.post("/queues/reports/resume", data={"csrf_token": token})

    assert retried.status_code == cancelled.status_code == 303
    assert retried.headers["location"] == f"/tasks/{seeded.failed}?notice=retried"
    assert paused.headers["location"] == "/?notice=paused"
    assert resumed.status_code == 303
    assert state_of(pgtask_engine, seeded.failed) == "pending"
    assert state_of(pgtask_engine, seeded.pending) == "cancelled"
    with pgtask_engine.connect() as connection:
        entries = list_audit(connection, limit=4)
        paused_now = {q.name: q.paused for q in list_queues(connection)}
    assert [(e.action, e.actor) for e in entries] == [
        ("queue.resume", "dashboard:carol"), ("queue.pause", "dashboard:carol"),
        ("task.cancel", "dashboard:carol"), ("task.retry", "dashboard:carol"),
    ]
    assert entries[-1].reason == "smtp is back"
    assert paused_now == {"emails": True, "reports": False}
    assert "The task will run again." in client.get(retried.headers["location"]).text


def test_bearer_token_acts_as_dashboard_token(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)

    answer = client.post(
        f"/tasks/{seeded.failed}/retry", data={"csrf_token": csrf(client)},
        headers={"authorization": f"Bearer {TOKEN}"},
    )

    assert answer.status_code == 303
    with pgtask_engine.connect() as connection:
        (entry,) = list_audit(connection, task_id=seeded.failed)
    assert entry.actor == "dashboard:token"


def test_a_refused_retry_is_a_409_page_and_writes_nothing(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    log_in(client)
    before = snapshot(pgtask_engine)

    answer = client.post(f"/tasks/{seeded.pending}/retry", data={"csrf_token": csrf(client)})

    assert answer.status_code == 409
    assert "pending" in answer.text
    assert snapshot(pgtask_engine) == before


class HeaderAuth:
    """A host application's own auth: ``X-User`` names the user, or the request is 401."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            user = dict(scope["headers"]).get(b"x-user")
            if user is None:
                await PlainTextResponse("who are you?", status_code=401)(scope, receive, send)
                return
            scope["host_user"] = user.decode()
        await self.app(scope, receive, send)


def test_mounted_under_a_prefix_with_the_host_auth_links_and_actions_work(
    pgtask_engine: Engine, seeded: Seeded
) -> None:
    def actor(request: Request) -> str | None:
        user = request.scope.get("host_user")
        return f"app:{user}" if user == "dave" else None

    async def home(request: Request) -> Response:
        return PlainTextResponse("host app")

    dashboard = create_app(pgtask_engine, actor_from_request=actor)
    host = Starlette(routes=[Mount("/pgtask", app=dashboard)])
    host.add_middleware(HeaderAuth)

    with TestClient(host, follow_redirects=False) as client:
        assert client.get("/pgtask/").status_code == 401
        client.headers["x-user"] = "dave"
        overview = client.get("/pgtask/")
        detail = client.get(f"/pgtask/tasks/{seeded.failed}")
        token = csrf(client, f"/pgtask/tasks/{seeded.failed}")
        retried = client.post(
            f"/pgtask/tasks/{seeded.failed}/retry", data={"csrf_token": token}
        )
        client.headers["x-user"] = "eve"  # signed in to the host, but not allowed to act
        refused = client.post(
            f"/pgtask/tasks/{seeded.pending}/cancel", data={"csrf_token": token}
        )
        css = client.get("/pgtask/static/dashboard.css")

    assert 'href="/pgtask/tasks"' in overview.text
    assert 'href="/pgtask/static/dashboard.css"' in overview.text
    assert f'action="/pgtask/tasks/{seeded.failed}/retry"' in detail.text
    assert "Path=/pgtask/" in overview.headers["set-cookie"]
    assert css.status_code == 200
    assert retried.status_code == 303
    assert retried.headers["location"] == f"/pgtask/tasks/{seeded.failed}?notice=retried"
    assert refused.status_code == 403
    assert state_of(pgtask_engine, seeded.pending) == "pending"
    with pgtask_engine.connect() as connection:
        (entry,) = list_audit(connection, task_id=seeded.failed)
    assert entry.actor == "app:dave"


def test_cli_dashboard_without_a_database_url_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PGTASK_DATABASE_URL", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["dashboard"])
    assert exited.value.code == 2
    assert "no database URL" in capsys.readouterr().err


def test_cli_dashboard_without_the_extra_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *rest: None if name == "uvicorn" else real(name, *rest),
    )
    with pytest.raises(SystemExit) as exited:
        main(["dashboard", "--database-url", "postgresql://nobody@127.0.0.1:1/none"])

    assert exited.value.code == 2
    assert 'pip install "sqlalchemy-pgtask[dashboard]"' in capsys.readouterr().err
