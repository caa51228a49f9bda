"""Fixtures of the dashboard tests: a seeded database, the app through Starlette's test client,
the app served by uvicorn on a free port, and a real headless Chromium.

The browser is Debian's ``chromium`` (``/usr/bin/chromium``), driven by Playwright: the
machine has no internet, so Playwright's own browser download is never used. Without the
browser, or without Playwright (it comes with the ``[dev]`` extra, not ``[test]``), the
browser tests skip, unless ``PGTASK_REQUIRE_BROWSER=1`` (CI sets it): then they fail, so CI
can never pass by skipping them.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pytest
import uvicorn
from sqlalchemy import Engine, create_engine, func, select
from starlette.applications import Starlette
from starlette.testclient import TestClient

from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.models import AuditEntry, Task
from sqlalchemy_pgtask.testing import ServerInfo, create_database, drop_database
from tests.dashboard.seed import Seeded, seed
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Playwright

#: Whether Playwright (the ``[dev]`` extra) is installed: the browser test modules import it.
HAVE_PLAYWRIGHT: Final = find_spec("playwright") is not None
_REQUIRED: Final = os.environ.get("PGTASK_REQUIRE_BROWSER") == "1"
if not HAVE_PLAYWRIGHT:
    if _REQUIRED:
        raise pytest.UsageError(
            "PGTASK_REQUIRE_BROWSER=1 but Playwright is not installed: pip install -e '.[dev]'"
        )
    collect_ignore_glob = ["test_browser*.py"]

CHROMIUM: Final = Path("/usr/bin/chromium")
#: Flags for a sandboxed, offline CI machine: no GPU, no network of Chromium's own.
CHROMIUM_ARGS: Final = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)
TOKEN: Final = "test-admin-token-0123456789"


@pytest.fixture
def seeded(pgtask_engine: Engine) -> Seeded:
    """The test's database, seeded (see `tests.dashboard.seed`)."""
    return seed(pgtask_engine)


@pytest.fixture(scope="module")
def shared(pgtask_server: ServerInfo, pgtask_template_database: str) -> Iterator[Shared]:
    """One seeded database for a module's tests that only read: seeding and dropping a
    database per test would cost more than the tests themselves."""
    url = create_database(pgtask_server.url, "pgtask_dash", template=pgtask_template_database)
    engine = create_engine(url)
    try:
        yield Shared(engine, seed(engine))
    finally:
        engine.dispose()
        drop_database(url)


class Shared(NamedTuple):
    engine: Engine
    seeded: Seeded


class Clients:
    """Test clients of ``create_app(engine, **options)``, closed together."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.open: list[TestClient] = []

    def __call__(self, **options: Any) -> TestClient:
        client = TestClient(create_app(self.engine, **options), follow_redirects=False)
        client.__enter__()
        self.open.append(client)
        return client

    def close(self) -> None:
        for client in self.open:
            client.__exit__(None, None, None)


@pytest.fixture
def client_for(pgtask_engine: Engine) -> Iterator[Callable[..., TestClient]]:
    """Make a test client of the app on this test's own database."""
    clients = Clients(pgtask_engine)
    yield clients
    clients.close()


@pytest.fixture
def shared_client_for(shared: Shared) -> Iterator[Callable[..., TestClient]]:
    """Make a test client of the app on the module's shared, seeded database."""
    clients = Clients(shared.engine)
    yield clients
    clients.close()


def snapshot(engine: Engine) -> tuple[int, list[tuple[Any, ...]]]:
    """The audit log's size and every task's mutable columns: what an action would change."""
    with engine.connect() as connection:
        entries = int(connection.scalar(select(func.count()).select_from(AuditEntry)) or 0)
        rows = connection.execute(
            select(Task.id, Task.state, Task.attempt, Task.failed_attempts, Task.updated_at,
                   Task.cancel_requested_at).order_by(Task.id)
        ).all()
    return entries, [tuple(row) for row in rows]


class LiveServer:
    """An app served by uvicorn in a thread on a free port of 127.0.0.1."""

    def __init__(self, app: Starlette) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/", timeout=2.0) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def __enter__(self) -> LiveServer:
        self._thread.start()
        wait_until(self._answers, 30.0, message="the dashboard to answer")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30.0)
        self._socket.close()


@pytest.fixture
def live(pgtask_engine: Engine, seeded: Seeded) -> Iterator[str]:
    """The seeded dashboard with an admin token, served over HTTP; its base URL."""
    with LiveServer(create_app(pgtask_engine, admin_token=TOKEN, page_size=20)) as server:
        yield server.url


@pytest.fixture(scope="module")
def playwright_instance() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: apt-get install chromium"
        if _REQUIRED:
            pytest.fail(f"PGTASK_REQUIRE_BROWSER=1 but {message}")
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        yield playwright


@pytest.fixture(scope="module")
def browser(playwright_instance: Playwright) -> Iterator[Browser]:
    """Debian's headless Chromium, one per test module (Playwright's sync API runs its own
    event loop: kept out of the way of other modules' asyncio tests)."""
    browser = playwright_instance.chromium.launch(
        executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS)
    )
    yield browser
    browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser context's page (its own cookies and storage), 15 s per step at most."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()
