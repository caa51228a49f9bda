"""``pgtask dashboard`` as an operator runs it: a real subprocess serving HTTP on a free port.

It answers with the overview of the database it was given; an operator who logs in with the
admin token (from ``--admin-token`` or ``$PGTASK_DASHBOARD_TOKEN``), through the login form's
CSRF double submit, may pause a queue, recorded in the audit log as ``dashboard:<name>``; the
same request without the login is refused and writes nothing. SIGTERM stops it cleanly.

Every wait polls with a deadline; the process is stopped (SIGTERM, then SIGKILL) at teardown
whatever the test did.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Final

import httpx2
import pytest

from sqlalchemy_pgtask import configure_queue, enqueue
from sqlalchemy_pgtask.queues import list_queues
from tests.acceptance.conftest import STARTUP_TIMEOUT, TOKEN_ENV, DashboardProcess, free_port
from tests.support.workerproc import PGTASK, Database, cli_env

TOKEN: Final = "acceptance-dashboard-token-5b2e"
QUEUE: Final = "invoices"
OPERATOR: Final = "dora"
CSRF_FIELD: Final = re.compile(r'<input type="hidden" name="csrf_token" value="([^"]+)">')


@pytest.fixture
def seeded(db: Database) -> Database:
    """The test's database with queue ``invoices`` configured and holding one pending task."""
    with db.engine.begin() as connection:
        configure_queue(connection, QUEUE, max_outstanding_tasks=500, actor="seed")
        enqueue(connection, "invoice.send", {"invoice": 1017}, queue=QUEUE)
    return db


def audit_of(db: Database) -> list[tuple[str, str, str | None]]:
    """Every audit entry, oldest first: (actor, action, queue)."""
    rows = db.rows("SELECT actor, action, queue FROM pgtask.audit_log ORDER BY id")
    return [(row.actor, row.action, row.queue) for row in rows]


def paused(db: Database, queue: str) -> bool:
    with db.engine.connect() as connection:
        return any(q.name == queue and q.paused for q in list_queues(connection))


def csrf_of(client: httpx2.Client, path: str) -> str:
    """GET ``path``; the CSRF token its form repeats, which must be the cookie's."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = CSRF_FIELD.findall(page.text)
    assert found, f"no CSRF field on {path}"
    cookie = client.cookies.get("pgtask_csrf")
    assert cookie is not None, "no CSRF cookie"
    assert set(found) == {cookie}
    return cookie


def client_of(dashboard: DashboardProcess) -> httpx2.Client:
    return httpx2.Client(base_url=dashboard.url, follow_redirects=False, timeout=10.0)


@pytest.mark.parametrize("token_from", ["--admin-token", TOKEN_ENV])
def test_the_served_dashboard_lets_a_logged_in_operator_pause_a_queue_and_refuses_others(
    dashboards: Callable[..., DashboardProcess], seeded: Database, token_from: str
) -> None:
    if token_from == TOKEN_ENV:
        dashboard = dashboards(seeded.url, env={TOKEN_ENV: TOKEN})
        cmdline = Path(f"/proc/{dashboard.process.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline
    else:
        dashboard = dashboards(seeded.url, "--admin-token", TOKEN)
    assert f"pgtask dashboard on {dashboard.url}/ (actions need the admin token)" in (
        dashboard.log()
    )
    before = audit_of(seeded)
    assert not paused(seeded, QUEUE)

    with client_of(dashboard) as anonymous, client_of(dashboard) as operator:
        overview = anonymous.get("/")
        assert overview.status_code == 200
        row = re.search(rf'<tr data-queue="{QUEUE}">(.*?)</tr>', overview.text, re.S)
        assert row is not None, overview.text
        assert "/ 500" in row.group(1)  # the seeded queue's capacity: this database's
        # Not logged in, with a valid CSRF token: refused, nothing written.
        refused = anonymous.post(
            f"/queues/{QUEUE}/pause", data={"csrf_token": csrf_of(anonymous, "/login")}
        )
        assert refused.status_code == 403
        assert "needs the admin token" in refused.text
        assert audit_of(seeded) == before
        assert not paused(seeded, QUEUE)
        # The right token without the form's CSRF field, or a wrong token, does not log in.
        csrf_of(operator, "/login")  # the CSRF cookie is set: only the field is missing
        forged = operator.post("/login", data={"token": TOKEN, "name": OPERATOR})
        assert forged.status_code == 403
        assert "CSRF" in forged.text
        wrong = operator.post("/login", data={
            "csrf_token": csrf_of(operator, "/login"), "token": "not-the-token", "name": OPERATOR,
        })
        assert wrong.status_code == 403
        assert "pgtask_session" not in operator.cookies
        # Logged in through the form (the CSRF double submit), the pause is done and audited.
        login = operator.post("/login", data={
            "csrf_token": csrf_of(operator, "/login"), "token": TOKEN, "name": OPERATOR,
        })
        assert login.status_code == 303, login.text
        assert "pgtask_session" in operator.cookies
        pause = operator.post(
            f"/queues/{QUEUE}/pause", data={"csrf_token": csrf_of(operator, "/")}
        )
        assert pause.status_code == 303, pause.text
        assert pause.headers["location"] == "/?notice=paused"
        after = operator.get("/")
        assert re.search(
            rf'<tr data-queue="{QUEUE}">.*?data-testid="paused"', after.text, re.S
        )

    assert audit_of(seeded) == [*before, (f"dashboard:{OPERATOR}", "queue.pause", QUEUE)]
    assert paused(seeded, QUEUE)
    # SIGTERM stops it within the timeout, after a graceful shutdown, without a traceback.
    code = dashboard.stop()
    assert not dashboard.killed, dashboard.describe()
    assert code == 0, dashboard.describe()
    assert "Traceback" not in dashboard.log()
    assert "Finished server process" in dashboard.log()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_sigint_stops_the_dashboard_command_with_exit_code_0(
    dashboards: Callable[..., DashboardProcess], seeded: Database, signum: int
) -> None:
    # SIGINT is Ctrl-C in a terminal: the same graceful stop, exit code 0, no traceback.
    dashboard = dashboards(seeded.url)

    code = dashboard.stop(signum)

    assert not dashboard.killed, dashboard.describe()
    assert code == 0, dashboard.describe()
    assert "Traceback" not in dashboard.log()


def test_session_max_age_sets_how_long_a_login_lasts_and_a_bad_one_is_a_usage_error(
    dashboards: Callable[..., DashboardProcess], seeded: Database
) -> None:
    dashboard = dashboards(seeded.url, "--admin-token", TOKEN, "--session-max-age", "600")
    with client_of(dashboard) as operator:
        login = operator.post("/login", data={
            "csrf_token": csrf_of(operator, "/login"), "token": TOKEN, "name": OPERATOR,
        })
        assert login.status_code == 303, login.text
        (cookie,) = [c for c in login.headers.get_list("set-cookie")
                     if c.startswith("pgtask_session=")]
        assert "Max-Age=600" in cookie

    refused = subprocess.run(
        [str(PGTASK), "dashboard", "--database-url", seeded.url, "--port", str(free_port()),
         "--session-max-age", "30"],
        env=cli_env(None), capture_output=True, text=True, timeout=STARTUP_TIMEOUT, check=False,
    )
    assert refused.returncode == 2, refused.stderr
    assert "session_max_age must be 60 s to 400 days, got 30" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_live_interval_sets_how_often_pages_refresh_and_zero_turns_it_off(
    dashboards: Callable[..., DashboardProcess], seeded: Database
) -> None:
    dashboard = dashboards(seeded.url, "--live-interval", "2")
    with client_of(dashboard) as visitor:
        page = visitor.get("/")
        fragment = visitor.get("/", headers={"X-Pgtask-Fragment": "live"})
    assert 'data-live-interval="2.0"' in page.text
    assert "static/live.js" in page.text
    assert fragment.headers["x-pgtask-fragment"] == "live"
    assert "<html" not in fragment.text

    off = dashboards(seeded.url, "--live-interval", "0")
    with client_of(off) as visitor:
        assert "live.js" not in visitor.get("/").text


def wrong_logins(operator: httpx2.Client, count: int, forwarded_for: str | None) -> list[int]:
    """The status of ``count`` logins with a wrong token, each naming ``forwarded_for`` (or,
    None, its own address) in ``X-Forwarded-For``: 403 while counted, 429 once throttled."""
    csrf = csrf_of(operator, "/login")
    statuses = []
    for index in range(count):
        address = forwarded_for or f"203.0.113.{index + 1}"
        response = operator.post(
            "/login", data={"csrf_token": csrf, "token": "wrong-token-guess", "name": "eve"},
            headers={"X-Forwarded-For": address},
        )
        statuses.append(response.status_code)
    return statuses


def test_a_client_cannot_pick_its_throttle_address_with_x_forwarded_for(
    dashboards: Callable[..., DashboardProcess], seeded: Database
) -> None:
    # uvicorn's own default believes X-Forwarded-For from 127.0.0.1, the peer of every
    # request through a tunnel: each guess naming a new address was never throttled.
    dashboard = dashboards(seeded.url, "--admin-token", TOKEN)
    with client_of(dashboard) as attacker:
        assert wrong_logins(attacker, 11, forwarded_for=None) == [403] * 10 + [429]


def test_forwarded_allow_ips_counts_each_client_behind_the_named_proxy_on_its_own(
    dashboards: Callable[..., DashboardProcess], seeded: Database
) -> None:
    dashboard = dashboards(
        seeded.url, "--admin-token", TOKEN, "--forwarded-allow-ips", "127.0.0.1"
    )
    with client_of(dashboard) as proxy:
        assert wrong_logins(proxy, 12, forwarded_for=None) == [403] * 12
        assert wrong_logins(proxy, 11, forwarded_for="198.51.100.7") == [403] * 10 + [429]
        # Another client behind the same proxy is not throttled by that one.
        assert wrong_logins(proxy, 1, forwarded_for="198.51.100.8") == [403]


def test_the_served_dashboard_holds_against_a_hostile_client_with_require_login(
    dashboards: Callable[..., DashboardProcess], seeded: Database
) -> None:
    """Issue 24 against the real process: nothing but the login without a token, a planted
    CSRF cookie does not survive the login, a logged-out session's copy does not act, the
    Host header reaches no URL, and the framework's own answers carry the headers."""
    dashboard = dashboards(seeded.url, "--admin-token", TOKEN, "--require-login")
    before = audit_of(seeded)
    planted = "p" * 43
    with client_of(dashboard) as anonymous, client_of(dashboard) as operator, \
            client_of(dashboard) as thief:
        for path in ("/", "/tasks", f"/tasks?q={QUEUE}", "/audit", "/workers", "/nowhere"):
            answer = anonymous.get(path)
            assert (answer.status_code, answer.headers.get("location")) == (303, "/login")
            assert QUEUE not in answer.text
        assert anonymous.post(f"/queues/{QUEUE}/pause").status_code == 401
        for method, path, code in (("GET", "/static/dashboard.css", 200),
                                   ("GET", "/static/nothing.css", 404),
                                   ("PUT", "/login", 405), ("GET", "/login", 200)):
            answer = anonymous.request(method, path)
            assert answer.status_code == code
            assert answer.headers["x-content-type-options"] == "nosniff"
            assert "content-security-policy" in answer.headers
            assert "referrer-policy" in answer.headers
        # A CSRF cookie planted before the login: the login issues its own.
        operator.cookies.set("pgtask_csrf", planted)
        assert csrf_of(operator, "/login") == planted
        login = operator.post(
            "/login", data={"csrf_token": planted, "token": TOKEN, "name": OPERATOR}
        )
        assert login.status_code == 303, login.text
        fresh = {c.name: c.value for c in operator.cookies.jar}
        assert fresh["pgtask_csrf"] != planted
        operator.cookies.clear()
        operator.cookies.update(fresh)
        forged = operator.post(f"/queues/{QUEUE}/pause", data={"csrf_token": planted})
        assert forged.status_code == 403
        assert audit_of(seeded) == before
        # The Host header never reaches a URL.
        moved = operator.get("/tasks/", headers={"host": "evil.example"})
        assert moved.status_code == 307
        assert moved.headers["location"] == "/tasks"
        assert "evil.example" not in operator.get("/tasks?limit=1").text
        # Logged out, a copy of the session cookie acts no more.
        thief.cookies.update(fresh)
        assert f"dashboard:{OPERATOR}" in thief.get("/").text
        assert operator.post(
            "/logout", data={"csrf_token": fresh["pgtask_csrf"]}
        ).status_code == 303
        replayed = thief.post(f"/queues/{QUEUE}/pause", data={"csrf_token": fresh["pgtask_csrf"]})
        assert replayed.status_code == 401
        assert thief.get("/").status_code == 303
    assert audit_of(seeded) == before
    assert not paused(seeded, QUEUE)
