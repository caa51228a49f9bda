"""A login lasts ``session_max_age`` (12 hours unless ``create_app`` is told otherwise): the
session cookie carries the login's time under its HMAC, so a cookie older than that, stamped
too far ahead, with its time changed, or of the previous format (no time: valid for ever) is
refused, and the browser is told to drop it when it expires (``Max-Age``)."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Final

import pytest
from sqlalchemy import Engine
from starlette.testclient import TestClient

from sqlalchemy_pgtask import configure_queue
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._security import Guard
from sqlalchemy_pgtask.queues import list_queues
from tests.dashboard.conftest import TOKEN
from tests.dashboard.test_refusals import csrf_of

Apps = Callable[..., TestClient]
SESSION: Final = "pgtask_session"
CSRF: Final = "pgtask_csrf"
HOUR: Final = 3600


def guard_of(client: TestClient) -> Guard:
    guard: Guard = client.app.state.dashboard.guard  # type: ignore[attr-defined]
    return guard


def acts_as(client: TestClient) -> str | None:
    """The actor the overview page shows, or None when it offers the login."""
    page = client.get("/").text
    marker = 'data-testid="actor">'
    if marker not in page:
        assert 'href="/login"' in page
        return None
    return page.split(marker, 1)[1].split("<", 1)[0]


def logged_in_at(client: TestClient, issued_at: float, name: str = "carol") -> None:
    client.cookies.set(SESSION, guard_of(client).session_value(name, issued_at, csrf_of(client)))


def set_cookie_of(answer: object) -> str:
    (cookie,) = [value for value in answer.headers.get_list("set-cookie")  # type: ignore[attr-defined]
                 if value.startswith(f"{SESSION}=")]
    return str(cookie)


@pytest.mark.parametrize(
    ("options", "max_age"),
    [({}, 12 * HOUR), ({"session_max_age": timedelta(hours=1)}, HOUR),
     ({"session_max_age": 90}, 90)],
    ids=["default", "timedelta", "seconds"],
)
def test_a_login_tells_the_browser_to_drop_the_cookie_at_the_max_age(
    shared_client_for: Apps, options: dict[str, object], max_age: int
) -> None:
    client = shared_client_for(admin_token=TOKEN, **options)

    answer = client.post(
        "/login", data={"csrf_token": csrf_of(client), "token": TOKEN, "name": "carol"}
    )

    assert answer.status_code == 303
    assert f"Max-Age={max_age}" in set_cookie_of(answer)
    assert acts_as(client) == "dashboard:carol"


@pytest.mark.parametrize(
    ("age", "accepted"),
    [(0, True), (HOUR - 60, True), (HOUR + 60, False), (30 * 86400, False),
     (-60, True), (-HOUR, False)],
    ids=["just-now", "a-minute-before-expiry", "a-minute-after-expiry", "a-month-old",
         "a-minute-ahead-of-this-clock", "an-hour-ahead-of-this-clock"],
)
def test_a_session_is_accepted_only_within_its_max_age(
    shared_client_for: Apps, age: int, accepted: bool
) -> None:
    client = shared_client_for(admin_token=TOKEN, session_max_age=HOUR)
    logged_in_at(client, time.time() - age)

    assert acts_as(client) == ("dashboard:carol" if accepted else None)


def test_an_expired_session_may_not_act_and_writes_nothing(
    client_for: Apps, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "emails", max_outstanding_tasks=10, actor="seed")
    client = client_for(admin_token=TOKEN, session_max_age=HOUR)
    logged_in_at(client, time.time() - 2 * HOUR)

    answer = client.post("/queues/emails/pause", data={"csrf_token": csrf_of(client)})

    assert answer.status_code == 403
    assert "This action needs the admin token" in answer.text
    with pgtask_engine.connect() as connection:
        assert not [q for q in list_queues(connection) if q.name == "emails" and q.paused]
    # The control: the same request with a fresh login pauses the queue.
    logged_in_at(client, time.time())
    assert client.post(
        "/queues/emails/pause", data={"csrf_token": csrf_of(client)}
    ).status_code == 303
    with pgtask_engine.connect() as connection:
        assert [q for q in list_queues(connection) if q.name == "emails" and q.paused]


def test_a_session_whose_login_time_was_changed_is_refused(shared_client_for: Apps) -> None:
    client = shared_client_for(admin_token=TOKEN, session_max_age=HOUR)
    name, issued, sid, mac = guard_of(client).session_value(
        "carol", time.time() - 2 * HOUR, csrf_of(client)
    ).split(":")
    client.cookies.set(SESSION, f"{name}:{int(time.time())}:{sid}:{mac}")

    assert acts_as(client) is None
    client.cookies.set(SESSION, f"{name}:{issued}:{sid}:{mac}")
    assert acts_as(client) is None  # still expired: the control that the MAC was genuine


def test_a_cookie_of_the_previous_format_is_refused(shared_client_for: Apps) -> None:
    """``name:HMAC(name)``: it held no time, so it never expired."""
    client = shared_client_for(admin_token=TOKEN)
    key = hashlib.sha256(
        b"sqlalchemy-pgtask dashboard session v1\x00" + TOKEN.encode()
    ).digest()
    client.cookies.set(SESSION, "carol:" + hmac.new(key, b"carol", hashlib.sha256).hexdigest())

    assert acts_as(client) is None


@pytest.mark.parametrize(
    "value", ["carol:1:2:3", "carol::", "carol:-5:ab", "carol:12x:ab", ":1:ab"]
)
def test_malformed_session_cookies_are_refused(shared_client_for: Apps, value: str) -> None:
    client = shared_client_for(admin_token=TOKEN)
    client.cookies.set(SESSION, value)

    assert acts_as(client) is None


@pytest.mark.parametrize(
    "value", [0, 59, -HOUR, 400 * 86400 + 1, timedelta(seconds=30), True, "12h", None],
    ids=repr,
)
def test_a_session_max_age_out_of_range_or_of_another_type_is_refused(
    pgtask_engine: Engine, value: object
) -> None:
    with pytest.raises(ValueError, match="session_max_age"):
        create_app(pgtask_engine, admin_token=TOKEN, session_max_age=value)  # type: ignore[arg-type]


def test_a_session_counts_only_beside_the_csrf_cookie_of_its_login(
    client_for: Apps, pgtask_engine: Engine
) -> None:
    # Whoever can plant cookies on the dashboard's host (a sibling subdomain, plain HTTP)
    # could choose the CSRF cookie and field: with the operator's session, that acted.
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "emails", max_outstanding_tasks=10, actor="seed")
    client = client_for(admin_token=TOKEN)
    login = client.post("/login", data={"csrf_token": csrf_of(client), "token": TOKEN,
                                        "name": "carol"})
    assert login.status_code == 303
    genuine = csrf_of(client)  # the login's own token

    planted = "p" * 43  # well formed, and the attacker's
    client.cookies.delete(CSRF)
    client.cookies.set(CSRF, planted)
    forged = client.post("/queues/emails/pause", data={"csrf_token": planted})

    assert forged.status_code == 403
    with pgtask_engine.connect() as connection:
        assert not [q for q in list_queues(connection) if q.name == "emails" and q.paused]
    assert acts_as(client) is None
    # The control: beside its own CSRF cookie the session acts.
    client.cookies.delete(CSRF)
    client.cookies.set(CSRF, genuine)
    assert client.post("/queues/emails/pause", data={"csrf_token": genuine}).status_code == 303
    with pgtask_engine.connect() as connection:
        assert [q for q in list_queues(connection) if q.name == "emails" and q.paused]
    # The login keeps the CSRF cookie as long as the session it is bound to.
    (kept,) = [c for c in login.headers.get_list("set-cookie") if c.startswith(f"{CSRF}=")]
    assert f"Max-Age={12 * HOUR}" in kept
