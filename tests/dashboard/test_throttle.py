"""Wrong admin tokens are counted per client address: after ten within five minutes, that
address's next tokens, the right one included, are not checked (the login answers 429 with
``Retry-After``; a ``Bearer`` header counts for nothing) until the oldest failure is five
minutes old. Other addresses are not affected, and a right token clears the count.

The throttle's clock is replaced by a fake one the tests move: no test sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import pytest
from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.testclient import TestClient

from sqlalchemy_pgtask import configure_queue
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._throttle import ADDRESSES, LIMIT, WINDOW, Throttle, Throttled
from sqlalchemy_pgtask.queues import list_queues
from tests.dashboard.conftest import TOKEN
from tests.dashboard.test_refusals import csrf_of

SESSION: Final = "pgtask_session"
WRONG: Final = "not-the-admin-token"


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class App:
    """One dashboard application whose throttle reads `clock`; clients from any address."""

    asgi: Starlette
    clock: Clock
    engine: Engine
    clients: list[TestClient]

    def client(self, address: str = "198.51.100.7") -> TestClient:
        client = TestClient(self.asgi, follow_redirects=False, client=(address, 40000))
        client.__enter__()
        self.clients.append(client)
        return client


@pytest.fixture
def app(pgtask_engine: Engine) -> Iterator[App]:
    clock = Clock()
    asgi = create_app(pgtask_engine, admin_token=TOKEN)
    asgi.state.dashboard.guard.throttle.clock = clock
    made = App(asgi, clock, pgtask_engine, [])
    yield made
    for client in made.clients:
        client.__exit__(None, None, None)


def log_in(client: TestClient, token: str) -> int:
    answer = client.post(
        "/login", data={"csrf_token": csrf_of(client), "token": token, "name": "carol"}
    )
    return answer.status_code


def test_after_ten_wrong_tokens_even_the_right_one_waits_for_the_window(app: App) -> None:
    client = app.client()
    for _ in range(LIMIT):
        assert log_in(client, WRONG) == 403

    refused = client.post(
        "/login", data={"csrf_token": csrf_of(client), "token": TOKEN, "name": "carol"}
    )
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == str(int(WINDOW))
    assert "Too many wrong tokens" in refused.text
    assert client.cookies.get(SESSION) is None

    app.clock.now += WINDOW - 1
    still = client.post(
        "/login", data={"csrf_token": csrf_of(client), "token": TOKEN, "name": "carol"}
    )
    assert still.status_code == 429
    assert still.headers["retry-after"] == "1"

    app.clock.now += 1.5
    assert log_in(client, TOKEN) == 303
    assert client.cookies.get(SESSION) is not None


def test_another_address_is_not_throttled(app: App) -> None:
    guesser = app.client("198.51.100.7")
    for _ in range(LIMIT):
        assert log_in(guesser, WRONG) == 403
    assert log_in(guesser, TOKEN) == 429

    assert log_in(app.client("203.0.113.9"), TOKEN) == 303


def test_a_right_token_clears_the_count(app: App) -> None:
    client = app.client()
    for _ in range(LIMIT - 1):
        assert log_in(client, WRONG) == 403
    assert log_in(client, TOKEN) == 303
    for _ in range(LIMIT - 1):
        assert log_in(client, WRONG) == 403
    assert log_in(client, TOKEN) == 303


def test_failures_older_than_the_window_no_longer_count(app: App) -> None:
    client = app.client()
    for _ in range(LIMIT - 1):
        assert log_in(client, WRONG) == 403
    app.clock.now += WINDOW + 1
    for _ in range(LIMIT - 1):
        assert log_in(client, WRONG) == 403
    assert log_in(client, TOKEN) == 303


def test_wrong_bearer_tokens_count_and_then_the_right_one_acts_for_nothing(app: App) -> None:
    with app.engine.begin() as connection:
        configure_queue(connection, "emails", max_outstanding_tasks=10, actor="seed")
    client = app.client()

    def pause(token: str) -> int:
        return client.post(
            "/queues/emails/pause", data={"csrf_token": csrf_of(client)},
            headers={"authorization": f"Bearer {token}"},
        ).status_code

    def paused() -> bool:
        with app.engine.connect() as connection:
            return any(q.name == "emails" and q.paused for q in list_queues(connection))

    for _ in range(LIMIT):
        assert pause(WRONG) == 403
    assert pause(TOKEN) == 403
    assert not paused()
    app.clock.now += WINDOW
    assert pause(TOKEN) == 303
    assert paused()


def test_a_request_counts_once_however_often_it_is_asked_who_it_is(app: App) -> None:
    """A refused action asks for the actor, then renders its page, which asks again."""
    with app.engine.begin() as connection:
        configure_queue(connection, "emails", max_outstanding_tasks=10, actor="seed")
    client = app.client()
    for _ in range(LIMIT - 1):
        answer = client.post(
            "/queues/emails/pause", data={"csrf_token": csrf_of(client)},
            headers={"authorization": f"Bearer {WRONG}"},
        )
        assert answer.status_code == 403
        assert "This action needs the admin token" in answer.text

    # Nine requests with a wrong token, each asked twice: nine guesses, not throttled.
    assert client.post(
        "/queues/emails/pause", data={"csrf_token": csrf_of(client)},
        headers={"authorization": f"Bearer {TOKEN}"},
    ).status_code == 303


def test_the_throttle_forgets_the_least_recently_failed_address_beyond_its_bound() -> None:
    clock = Clock()
    throttle = Throttle(clock)
    for _ in range(LIMIT):
        throttle.failed("first")
    with pytest.raises(Throttled):
        throttle.check("first")
    for n in range(ADDRESSES):
        throttle.failed(f"other-{n}")

    throttle.check("first")  # forgotten: the bound holds the newest ADDRESSES addresses
    for _ in range(LIMIT - 1):
        throttle.failed("other-0")
    with pytest.raises(Throttled):  # kept: one failure of its own, then these nine
        throttle.check("other-0")


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    assert Throttled(0.2).retry_after == 1
    assert Throttled(1.0).retry_after == 1
    assert Throttled(1.01).retry_after == 2
    assert Throttled(-3).retry_after == 1


def test_a_dashboard_without_a_token_refuses_every_login_with_403_and_counts_none(
    pgtask_engine: Engine,
) -> None:
    # Read-only: a login is refused, as documented; it used to count as a wrong guess, so
    # the eleventh answered 429.
    with TestClient(create_app(pgtask_engine), follow_redirects=False) as client:
        assert [log_in(client, TOKEN) for _ in range(LIMIT + 2)] == [403] * (LIMIT + 2)
