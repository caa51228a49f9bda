"""Issue 24, item 2 and 4, over HTTP with a cookie jar: a CSRF cookie planted before the login
is not kept by it, logging out ends the session for every copy of its cookie, the Host header
never reaches a URL, every response carries the security headers, and ``require_login``
serves nothing but the login page to a visitor without a token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pytest
from sqlalchemy import Engine
from starlette.testclient import TestClient

from sqlalchemy_pgtask import configure_queue
from sqlalchemy_pgtask.queues import list_queues
from tests.dashboard.conftest import TOKEN, Shared, snapshot

Apps = Callable[..., TestClient]
CSRF: Final = "pgtask_csrf"
SESSION: Final = "pgtask_session"
PLANTED: Final = "p" * 43  # well formed, and the attacker's
HEADERS: Final = ("content-security-policy", "x-content-type-options", "referrer-policy")


def paused(engine: Engine, queue: str) -> bool:
    with engine.connect() as connection:
        return any(q.name == queue and q.paused for q in list_queues(connection))


def log_in(client: TestClient, name: str = "carol") -> str:
    """Log in through the form; the CSRF token the login set."""
    client.get("/login")
    csrf = client.cookies[CSRF]
    answer = client.post("/login", data={"csrf_token": csrf, "token": TOKEN, "name": name})
    assert answer.status_code == 303, answer.text
    return client.cookies[CSRF]


def set_by(answer: object) -> dict[str, str]:
    """The cookies a response sets: name to value."""
    cookies = {}
    for header in answer.headers.get_list("set-cookie"):  # type: ignore[attr-defined]
        name, _, rest = header.partition("=")
        cookies[name] = rest.split(";", 1)[0]
    return cookies


@pytest.fixture
def emails(pgtask_engine: Engine) -> str:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "emails", max_outstanding_tasks=10, actor="seed")
    return "emails"


def test_a_csrf_cookie_planted_before_the_login_does_not_let_a_forged_post_act(
    client_for: Apps, pgtask_engine: Engine, emails: str
) -> None:
    client = client_for(admin_token=TOKEN)
    client.cookies.set(CSRF, PLANTED)
    page = client.get("/login")
    assert PLANTED in page.text  # the planted token is the form's before the login

    login = client.post("/login", data={"csrf_token": PLANTED, "token": TOKEN, "name": "carol"})
    assert login.status_code == 303
    issued = set_by(login)
    assert issued[CSRF] != PLANTED  # the login issued its own
    before = snapshot(pgtask_engine)
    # The attacker's forged form carries the planted token; the browser's cookie is the
    # login's, or the attacker planted theirs again: refused both ways, nothing written.
    for csrf_cookie in (issued[CSRF], PLANTED):
        client.cookies.clear()
        client.cookies.set(SESSION, issued[SESSION])
        client.cookies.set(CSRF, csrf_cookie)
        forged = client.post(f"/queues/{emails}/pause", data={"csrf_token": PLANTED})
        assert forged.status_code == 403
    assert snapshot(pgtask_engine) == before
    assert not paused(pgtask_engine, emails)


def test_the_login_issues_a_fresh_csrf_token_that_acts(
    client_for: Apps, pgtask_engine: Engine, emails: str
) -> None:
    """The control of the fixation test: the login's own token acts."""
    client = client_for(admin_token=TOKEN)
    csrf = log_in(client)

    assert client.post(f"/queues/{emails}/pause", data={"csrf_token": csrf}).status_code == 303
    assert paused(pgtask_engine, emails)


def test_a_copied_session_cookie_stops_acting_after_the_logout(
    pgtask_engine: Engine, emails: str
) -> None:
    from sqlalchemy_pgtask.dashboard import create_app

    app = create_app(pgtask_engine, admin_token=TOKEN)
    with TestClient(app, follow_redirects=False) as operator, \
            TestClient(app, follow_redirects=False) as thief:
        csrf = log_in(operator)
        for name in (CSRF, SESSION):
            thief.cookies.set(name, operator.cookies[name])
        assert "dashboard:carol" in thief.get("/").text  # the copy acts before the logout

        assert operator.post("/logout", data={"csrf_token": csrf}).status_code == 303
        before = snapshot(pgtask_engine)
        replayed = thief.post(f"/queues/{emails}/pause", data={"csrf_token": csrf})

        assert replayed.status_code == 403
        assert snapshot(pgtask_engine) == before
        assert not paused(pgtask_engine, emails)
        assert "dashboard:carol" not in thief.get("/").text


@pytest.mark.parametrize(
    "path", ["/tasks/", "/audit/", "/tasks/?state=failed"]
)
def test_a_redirect_never_names_the_request_host(shared_client_for: Apps, path: str) -> None:
    client = shared_client_for(admin_token=TOKEN)

    answer = client.get(path, headers={"host": "evil.example"})

    assert answer.status_code in {307, 404}
    assert "evil.example" not in answer.headers.get("location", "")
    assert "evil.example" not in answer.text
    if answer.status_code == 307:
        assert answer.headers["location"].startswith("/")
        assert not answer.headers["location"].startswith("//")


@pytest.mark.parametrize("path", ["/tasks?limit=1", "/audit?limit=1"])
def test_paging_links_are_paths_never_the_request_host(
    shared_client_for: Apps, path: str
) -> None:
    client = shared_client_for(admin_token=TOKEN)

    page = client.get(path, headers={"host": "evil.example"})

    assert page.status_code == 200
    assert "Older" in page.text
    assert "evil.example" not in page.text


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/static/dashboard.css", 200), ("GET", "/no-such-page", 404),
     ("GET", "/static/missing.css", 404), ("PUT", "/tasks", 405), ("GET", "/logout", 405),
     ("GET", "/", 200)],
)
def test_every_response_carries_the_security_headers(
    shared_client_for: Apps, method: str, path: str, status: int
) -> None:
    client = shared_client_for(admin_token=TOKEN)

    answer = client.request(method, path)

    assert answer.status_code == status
    for header in HEADERS:
        assert header in answer.headers, (header, dict(answer.headers))
    assert answer.headers["x-content-type-options"] == "nosniff"


PAGES: Final = ("/", "/tasks", "/workers", "/schedules", "/audit", "/no-such-page")


@pytest.mark.parametrize("path", [*PAGES, "/tasks/{task}", "/tasks?q={key}"])
def test_require_login_shows_a_visitor_without_a_token_nothing_but_the_login(
    shared_client_for: Apps, shared: Shared, path: str
) -> None:
    path = path.format(task=shared.seeded.failed, key="k")
    client = shared_client_for(admin_token=TOKEN, require_login=True)

    answer = client.get(path)

    assert answer.status_code == 303
    assert answer.headers["location"] == "/login"
    assert answer.text == ""
    for header in HEADERS:
        assert header in answer.headers
    assert client.get("/login").status_code == 200
    assert client.get("/static/dashboard.css").status_code == 200
    assert client.post("/queues/emails/pause", data={}).status_code == 401


def test_require_login_serves_the_pages_after_a_login_or_with_the_bearer_token(
    shared_client_for: Apps
) -> None:
    client = shared_client_for(admin_token=TOKEN, require_login=True)
    log_in(client)
    bearer = shared_client_for(admin_token=TOKEN, require_login=True)

    for path in PAGES[:-1]:
        assert client.get(path).status_code == 200
        assert bearer.get(path, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_require_login_without_a_way_to_log_in_is_refused(pgtask_engine: Engine) -> None:
    from sqlalchemy_pgtask.dashboard import create_app

    with pytest.raises(ValueError, match="require_login"):
        create_app(pgtask_engine, require_login=True)


def test_over_https_the_cookies_are_host_prefixed_and_plain_names_are_ignored(
    pgtask_engine: Engine, emails: str
) -> None:
    from sqlalchemy_pgtask.dashboard import create_app

    app = create_app(pgtask_engine, admin_token=TOKEN)
    with TestClient(app, base_url="https://testserver", follow_redirects=False) as client:
        page = client.get("/login")
        (csrf_header,) = page.headers.get_list("set-cookie")
        assert csrf_header.startswith(f"__Host-{CSRF}=")
        csrf = set_by(page)[f"__Host-{CSRF}"]
        login = client.post("/login", data={"csrf_token": csrf, "token": TOKEN, "name": "carol"})
        assert login.status_code == 303
        headers = login.headers.get_list("set-cookie")
        names = sorted(header.split("=", 1)[0] for header in headers)
        assert names == [f"__Host-{CSRF}", f"__Host-{SESSION}"]
        for header in headers:
            attributes = [part.strip().lower() for part in header.split(";")]
            assert "secure" in attributes
            assert "path=/" in attributes
            assert not any(part.startswith("domain=") for part in attributes)
        issued = set_by(login)
        # A cookie of the plain name (planted over HTTP, or by a sibling) counts for nothing.
        client.cookies.clear()
        client.cookies.set(f"__Host-{SESSION}", issued[f"__Host-{SESSION}"])
        client.cookies.set(CSRF, PLANTED)
        forged = client.post(f"/queues/{emails}/pause", data={"csrf_token": PLANTED})
        assert forged.status_code == 403
        assert not paused(pgtask_engine, emails)
        # The control: beside its own __Host- CSRF cookie the session acts.
        client.cookies.clear()
        client.cookies.set(f"__Host-{SESSION}", issued[f"__Host-{SESSION}"])
        client.cookies.set(f"__Host-{CSRF}", issued[f"__Host-{CSRF}"])
        acted = client.post(
            f"/queues/{emails}/pause", data={"csrf_token": issued[f"__Host-{CSRF}"]}
        )
        assert acted.status_code == 303
        assert paused(pgtask_engine, emails)
