"""Every dashboard action without authority, or without its CSRF token, is refused and writes
nothing; a login that fails sets no session.

"Writes nothing" is checked on a snapshot of every row of every table of the ``pgtask``
schema (the audit log, every task's columns, every queue's pause and settings, schedules,
attempts, idempotency keys ...), taken before and after the request, on a database of the
test's own: a refusal that did write could not leak into another test. Controls show the
snapshot sees each action's write and that the requests reach the code that refuses them (a
replayed cookie is sent, the hook is asked), so no refusal passes by accident.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

import httpx2
import pytest
from sqlalchemy import Engine, text
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient

from sqlalchemy_pgtask import configure_queue, enqueue, pause_queue, set_schedule
from sqlalchemy_pgtask.dashboard import create_app
from tests.dashboard.conftest import TOKEN, Shared
from tests.dashboard.seed import fail_task

Apps = Callable[..., TestClient]
#: Table name -> its rows as JSON text, sorted.
Snapshot = Mapping[str, tuple[str, ...]]

OTHER_TOKEN: Final = "another-admin-token-9876543210"
#: The admin token with its last character changed: same length, same prefix.
NEAR_MISS: Final = TOKEN[:-1] + ("X" if TOKEN[-1] != "X" else "Y")
SESSION: Final = "pgtask_session"
CSRF_COOKIE: Final = "pgtask_csrf"
NEEDS_TOKEN: Final = "This action needs the admin token: log in first."
CSRF_REFUSED: Final = "CSRF token is missing or wrong"


# -- the snapshot -------------------------------------------------------------------------


def snapshot(engine: Engine) -> Snapshot:
    """Every row of every table in the ``pgtask`` schema, as JSON text, per table: what any
    action (or a bug in a refusal) could write."""
    with engine.connect() as connection:
        tables = connection.scalars(text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'pgtask' ORDER BY tablename"
        )).all()
        return {
            table: tuple(connection.scalars(text(
                f'SELECT to_jsonb(t)::text FROM pgtask."{table}" AS t ORDER BY 1'
            )))
            for table in tables
        }


def changed(before: Snapshot, after: Snapshot) -> set[str]:
    """The tables whose rows differ."""
    return {t for t in before.keys() | after.keys() if before.get(t) != after.get(t)}


def rows(snap: Snapshot, table: str) -> list[dict[str, object]]:
    return [json.loads(row) for row in snap[table]]


def paused_at(snap: Snapshot, queue: str) -> object:
    (row,) = [r for r in rows(snap, "queues") if r["name"] == queue]
    return row["paused_at"]


def state(snap: Snapshot, task_id: object) -> object:
    (row,) = [r for r in rows(snap, "tasks") if r["id"] == str(task_id)]
    return row["state"]


# -- requests -----------------------------------------------------------------------------


def csrf_of(client: TestClient) -> str:
    """The client's CSRF token (any page sets the cookie)."""
    if client.cookies.get(CSRF_COOKIE) is None:
        assert client.get("/login").status_code == 200
    token = client.cookies.get(CSRF_COOKIE)
    assert token is not None
    return token


def log_in(client: TestClient, name: str = "carol", token: str = TOKEN) -> dict[str, str]:
    """Log in with ``token``; returns the cookies of the login: the session and the CSRF
    cookie it is bound to (a fresh one: the login never keeps the one it came with)."""
    before = csrf_of(client)
    answer = client.post("/login", data={"csrf_token": before, "token": token, "name": name})
    assert answer.status_code == 303
    session, csrf = client.cookies.get(SESSION), client.cookies.get(CSRF_COOKIE)
    assert session is not None
    assert csrf is not None
    assert csrf != before
    assert f"dashboard:{name}" in client.get("/").text
    return {SESSION: session, CSRF_COOKIE: csrf}


def replay(client: TestClient, cookies: dict[str, str]) -> TestClient:
    for name, value in cookies.items():
        client.cookies.set(name, value)
    return client


def sets_session(answer: httpx2.Response) -> bool:
    """Whether the response sets (or clears) the session cookie."""
    return any(f"{SESSION}=" in value for value in answer.headers.get_list("set-cookie"))


@dataclass(frozen=True)
class Targets:
    """What each action would change: a failed and a pending task; the queue ``emails``
    (active) and ``reports`` (paused); a pending task of queue ``default`` (for a bulk
    cancel) and the schedule ``nightly``."""

    failed: uuid.UUID
    pending: uuid.UUID
    spare: uuid.UUID


@pytest.fixture
def targets(pgtask_engine: Engine) -> Targets:
    """This test's own database, with just what the actions act on: the full seed would
    double the time of these many small tests."""
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "emails", max_outstanding_tasks=100, actor="seed")
        failed = enqueue(connection, "emails.send", {"to": "a@example.com"}, queue="emails",
                         idempotency_key="order-1").id
        fail_task(connection, failed, {"type": "handler_error", "message": "smtp down"})
        pending = enqueue(connection, "reports.build", {"month": "2026-11"}, queue="reports").id
        pause_queue(connection, "reports", actor="alice", reason="month-end freeze")
        spare = enqueue(connection, "orders.ship", {"order": 7}).id
        set_schedule(connection, "nightly", task="reports.build", cron="0 3 * * *",
                     queue="reports", actor="seed")
    return Targets(failed, pending, spare)


#: Every action, as the path of a request that would change something.
ACTIONS: Final[dict[str, Callable[[Targets], str]]] = {
    "retry-a-failed-task": lambda s: f"/tasks/{s.failed}/retry",
    "cancel-a-pending-task": lambda s: f"/tasks/{s.pending}/cancel",
    "pause-a-queue": lambda s: "/queues/emails/pause",
    "resume-a-paused-queue": lambda s: "/queues/reports/resume",
    "pause-a-schedule": lambda s: "/schedules/nightly/pause",
    "confirm-a-bulk-cancel": lambda s: "/tasks/bulk/cancel",
}
#: The form fields an action needs besides the CSRF token (a confirmed bulk cancel of the
#: queue ``default``, counted long ago).
FIELDS: Final[dict[str, dict[str, str]]] = {
    "confirm-a-bulk-cancel": {
        "queue": "default", "confirm": "yes", "as_of": "9999-01-01T00:00:00+00:00",
    },
}


def test_the_refusal_tests_cover_every_post_route_of_the_dashboard() -> None:
    app = create_app("postgresql://nobody@127.0.0.1:1/none", admin_token=TOKEN)
    posts = {
        r.path for r in app.routes if isinstance(r, Route) and "POST" in (r.methods or ())
    }
    assert posts == {
        "/login", "/logout", "/tasks/{task_id}/retry", "/tasks/{task_id}/cancel",
        "/queues/{queue}/pause", "/queues/{queue}/resume", "/schedules/{schedule}/{action}",
        "/tasks/bulk/{action}",
    }
    # The six that write are ACTIONS (login and logout are tested below).
    assert len(ACTIONS) == len(posts) - 2


# -- every way of lacking authority ------------------------------------------------------


@dataclass
class Caller:
    """A client that lacks authority, and how it asks."""

    client: TestClient
    headers: dict[str, str] = field(default_factory=dict)
    #: The paths the host's hook was asked about, when the app has one.
    hook_calls: list[str] | None = None


def no_credentials(apps: Apps) -> Caller:
    return Caller(apps(admin_token=TOKEN))


def wrong_bearer_token(apps: Apps) -> Caller:
    return Caller(apps(admin_token=TOKEN), {"authorization": f"Bearer {NEAR_MISS}"})


def forged_session_cookie(apps: Apps) -> Caller:
    """The cookie's format (``name:<login time>:<64 hex digits>``) with an unkeyed hash."""
    client = apps(admin_token=TOKEN)
    issued = str(int(time.time()))
    digest = hashlib.sha256(f"carol\x00{issued}".encode()).hexdigest()
    client.cookies.set(SESSION, f"carol:{issued}:{digest}")
    return Caller(client)


def cookie_of_another_token(apps: Apps) -> Caller:
    """A genuine session cookie, made by a dashboard with another admin token."""
    cookies = log_in(apps(admin_token=OTHER_TOKEN), token=OTHER_TOKEN)
    return Caller(replay(apps(admin_token=TOKEN), cookies))


def hook_returning_none(apps: Apps) -> Caller:
    """Only the host's hook, which refuses; the real token sent too (no token is set)."""
    calls: list[str] = []

    def hook(request: Request) -> str | None:
        calls.append(request.url.path)
        return None

    return Caller(
        apps(actor_from_request=hook), {"authorization": f"Bearer {TOKEN}"}, hook_calls=calls
    )


def read_only_app(apps: Apps) -> Caller:
    """No token and no hook: even the real token and a genuine session cookie are nothing."""
    cookies = log_in(apps(admin_token=TOKEN))
    return Caller(replay(apps(), cookies), {"authorization": f"Bearer {TOKEN}"})


LACKING: Final[dict[str, Callable[[Apps], Caller]]] = {
    "no-credentials": no_credentials,
    "wrong-bearer-token": wrong_bearer_token,
    "forged-session-cookie": forged_session_cookie,
    "cookie-of-another-admin-token": cookie_of_another_token,
    "hook-returning-none": hook_returning_none,
    "read-only-app": read_only_app,
}


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("lacking", LACKING)
def test_an_action_without_authority_is_refused_with_403_and_writes_nothing(
    client_for: Apps, pgtask_engine: Engine, targets: Targets, lacking: str, action: str
) -> None:
    caller = LACKING[lacking](client_for)
    path = ACTIONS[action](targets)
    csrf = csrf_of(caller.client)
    before = snapshot(pgtask_engine)

    answer = caller.client.post(
        path, data={"csrf_token": csrf, "reason": "must not be written", **FIELDS.get(action, {})},
        headers=caller.headers,
    )

    assert answer.status_code == 403
    assert NEEDS_TOKEN in answer.text  # refused for the actor, past the CSRF check
    assert not sets_session(answer)
    assert changed(before, snapshot(pgtask_engine)) == set()
    if caller.hook_calls is not None:
        assert path in caller.hook_calls


def test_the_snapshot_sees_what_each_allowed_action_writes(
    client_for: Apps, pgtask_engine: Engine, targets: Targets
) -> None:
    """The control of the refusals: the same requests with the token do write, and the
    snapshot shows it (audit log, task state, queue pause)."""
    client = client_for(admin_token=TOKEN)
    csrf = csrf_of(client)
    bearer = {"authorization": f"Bearer {TOKEN}"}
    seen: dict[str, set[str]] = {}
    snap = snapshot(pgtask_engine)
    assert {"audit_log", "tasks", "attempts", "queues", "schedules"} <= snap.keys()
    assert state(snap, targets.failed) == "failed"
    assert state(snap, targets.pending) == "pending"
    assert paused_at(snap, "emails") is None
    assert paused_at(snap, "reports") is not None

    for action, path in ACTIONS.items():
        before = snapshot(pgtask_engine)
        answer = client.post(path(targets), data={"csrf_token": csrf, **FIELDS.get(action, {})},
                             headers=bearer)
        assert answer.status_code == (200 if action in FIELDS else 303), action
        after = snapshot(pgtask_engine)
        assert len(after["audit_log"]) == len(before["audit_log"]) + 1, action
        seen[action] = changed(before, after) & {"tasks", "queues", "schedules"}

    assert "tasks" in seen["retry-a-failed-task"]  # and the capacity counter of its queue
    assert "tasks" in seen["cancel-a-pending-task"]
    assert seen["pause-a-queue"] == seen["resume-a-paused-queue"] == {"queues"}
    assert seen["pause-a-schedule"] == {"schedules"}
    assert seen["confirm-a-bulk-cancel"] == {"tasks"}
    snap = snapshot(pgtask_engine)
    assert state(snap, targets.failed) == "pending"
    assert state(snap, targets.pending) == "cancelled"
    assert paused_at(snap, "emails") is not None
    assert paused_at(snap, "reports") is None
    assert state(snap, targets.spare) == "cancelled"


def test_a_session_cookie_replayed_on_a_dashboard_with_the_same_token_may_act(
    client_for: Apps, pgtask_engine: Engine, targets: Targets
) -> None:
    """The control of the cookie refusals: cookies set on a client this way are sent, and a
    genuine login's are accepted by the process that issued them, so a refused one was
    refused for its signature (sessions are per process: another app refuses it)."""
    app = create_app(pgtask_engine, admin_token=TOKEN)
    with TestClient(app, follow_redirects=False) as operator, \
            TestClient(app, follow_redirects=False) as other:
        client = replay(other, log_in(operator))

        answer = client.post("/queues/emails/pause", data={"csrf_token": csrf_of(client)})

        assert answer.status_code == 303
        assert paused_at(snapshot(pgtask_engine), "emails") is not None
        assert "dashboard:carol" in client.get("/").text


def test_a_forged_session_cookie_with_a_non_ascii_signature_is_refused_not_a_server_error(
    pgtask_engine: Engine, targets: Targets
) -> None:
    app = create_app(pgtask_engine, admin_token=TOKEN)
    with TestClient(app, follow_redirects=False, raise_server_exceptions=False) as client:
        csrf = csrf_of(client)
        before = snapshot(pgtask_engine)
        # A raw header: the client's cookie jar would not send non-ASCII. Starlette reads
        # header bytes as latin-1, so the signature is "Ã©".
        cookie = f"{CSRF_COOKIE}={csrf}; {SESSION}=carol:".encode() + "é".encode()

        answer = client.post(
            "/queues/emails/pause", data={"csrf_token": csrf}, headers={"cookie": cookie}
        )

        assert answer.status_code == 403
        assert NEEDS_TOKEN in answer.text
    assert changed(before, snapshot(pgtask_engine)) == set()


def test_a_page_with_a_non_ascii_session_cookie_renders_logged_out(shared: Shared) -> None:
    app = create_app(shared.engine, admin_token=TOKEN)
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/", headers={"cookie": f"{SESSION}=carol:".encode() + b"\xe9"})

    assert answer.status_code == 200
    assert 'href="/login"' in answer.text


# -- CSRF ---------------------------------------------------------------------------------


@dataclass
class Post:
    """A POST without a matching CSRF token, from a client with authority."""

    client: TestClient
    data: dict[str, str]
    headers: dict[str, str] = field(default_factory=dict)


def csrf_field_missing(apps: Apps) -> Post:
    client = apps(admin_token=TOKEN)
    log_in(client)
    return Post(client, {"reason": "no token"})


def csrf_field_of_another_session(apps: Apps) -> Post:
    """The field holds a genuine token: the attacker's own, not the victim's cookie's."""
    client, attacker = apps(admin_token=TOKEN), apps(admin_token=TOKEN)
    log_in(client)
    theirs = csrf_of(attacker)
    assert theirs != csrf_of(client)
    return Post(client, {"csrf_token": theirs})


def csrf_cookie_absent(apps: Apps) -> Post:
    """The field holds the token the cookie had; the cookie is not sent."""
    client = apps(admin_token=TOKEN)
    log_in(client)
    token = csrf_of(client)
    client.cookies.delete(CSRF_COOKIE)
    assert client.cookies.get(CSRF_COOKIE) is None
    return Post(client, {"csrf_token": token})


def bearer_token_without_csrf(apps: Apps) -> Post:
    """The real bearer token does not exempt a POST from CSRF (docs: whatever its
    credentials)."""
    return Post(apps(admin_token=TOKEN), {}, {"authorization": f"Bearer {TOKEN}"})


NO_CSRF: Final[dict[str, Callable[[Apps], Post]]] = {
    "csrf-field-missing": csrf_field_missing,
    "csrf-field-of-another-session": csrf_field_of_another_session,
    "csrf-cookie-absent": csrf_cookie_absent,
    "bearer-token-without-csrf": bearer_token_without_csrf,
}


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("way", NO_CSRF)
def test_an_action_without_a_matching_csrf_token_is_refused_with_403_and_writes_nothing(
    client_for: Apps, pgtask_engine: Engine, targets: Targets, way: str, action: str
) -> None:
    post = NO_CSRF[way](client_for)
    before = snapshot(pgtask_engine)

    data = {**post.data, **FIELDS.get(action, {})}
    answer = post.client.post(ACTIONS[action](targets), data=data, headers=post.headers)

    assert answer.status_code == 403
    assert CSRF_REFUSED in answer.text
    assert changed(before, snapshot(pgtask_engine)) == set()


# -- login and logout ---------------------------------------------------------------------


@pytest.fixture
def guarded(shared_client_for: Apps) -> TestClient:
    """A client of the dashboard with the token on the shared database (a login writes
    nothing to the database: only cookies are at stake)."""
    return shared_client_for(admin_token=TOKEN)


LOGIN_FAILURES: Final[dict[str, Callable[[TestClient], dict[str, str]]]] = {
    "csrf-field-missing": lambda c: {"token": TOKEN, "name": "carol"},
    "csrf-field-wrong": lambda c: {"csrf_token": "A" * 43, "token": TOKEN, "name": "carol"},
    "csrf-field-empty": lambda c: {"csrf_token": "", "token": TOKEN, "name": "carol"},
    "wrong-token": lambda c: {"csrf_token": csrf_of(c), "token": "guess-guess", "name": "c"},
    "token-one-character-off": lambda c: {"csrf_token": csrf_of(c), "token": NEAR_MISS},
    "token-prefix": lambda c: {"csrf_token": csrf_of(c), "token": TOKEN[:-1]},
    "token-with-a-suffix": lambda c: {"csrf_token": csrf_of(c), "token": TOKEN + "0"},
    "empty-token": lambda c: {"csrf_token": csrf_of(c), "token": ""},
    "token-of-another-dashboard": lambda c: {"csrf_token": csrf_of(c), "token": OTHER_TOKEN},
}


@pytest.mark.parametrize("failure", LOGIN_FAILURES)
def test_a_failed_login_is_403_and_sets_no_session_cookie(
    guarded: TestClient, failure: str
) -> None:
    csrf_of(guarded)
    data = LOGIN_FAILURES[failure](guarded)

    answer = guarded.post("/login", data=data)

    assert answer.status_code == 403
    assert not sets_session(answer)
    assert guarded.cookies.get(SESSION) is None
    page = guarded.get("/")
    assert 'data-testid="actor"' not in page.text
    assert 'href="/login"' in page.text


def test_a_login_without_the_csrf_cookie_sets_no_session_cookie(guarded: TestClient) -> None:
    token = csrf_of(guarded)
    guarded.cookies.delete(CSRF_COOKIE)

    answer = guarded.post("/login", data={"csrf_token": token, "token": TOKEN})

    assert answer.status_code == 403
    assert "CSRF" in answer.text
    assert not sets_session(answer)


def test_a_login_with_the_token_and_the_csrf_token_sets_the_session_cookie(
    guarded: TestClient,
) -> None:
    """The control of the failed logins: the same request, right, does set the cookie."""
    answer = guarded.post(
        "/login", data={"csrf_token": csrf_of(guarded), "token": TOKEN, "name": "carol"}
    )

    assert answer.status_code == 303
    assert sets_session(answer)
    assert 'data-testid="actor">dashboard:carol<' in guarded.get("/").text


def test_a_read_only_dashboard_logs_no_one_in_even_with_a_token(
    shared_client_for: Apps,
) -> None:
    client = shared_client_for()

    answer = client.post("/login", data={"csrf_token": csrf_of(client), "token": TOKEN})

    assert answer.status_code == 403
    assert not sets_session(answer)
    assert "read-only" in client.get("/").text


def test_a_logout_without_the_csrf_token_keeps_the_session(guarded: TestClient) -> None:
    log_in(guarded)

    answer = guarded.post("/logout", data={})

    assert answer.status_code == 403
    assert "CSRF" in answer.text
    assert not sets_session(answer)
    assert "dashboard:carol" in guarded.get("/").text
