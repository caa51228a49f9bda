"""docs/screenshots.py: regenerate the dashboard screenshots in docs/images/ (run on demand).

::

    .venv/bin/python docs/screenshots.py [--database-url URL]

Creates a throwaway database (``--database-url``, else the server that
``provide_server(url_env="PGTASK_TEST_DATABASE_URL")`` finds), seeds it like the dashboard's
tests (`tests.dashboard.seed`) plus one realistic failure, serves the dashboard with an admin
token, logs in with Debian's headless Chromium and writes ``overview.png``, ``tasks.png``,
``task.png``, ``workers.png``, ``schedules.png`` and ``audit.png``. Needs the ``test`` extra
and ``/usr/bin/chromium``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.dashboard.*

from playwright.sync_api import sync_playwright  # noqa: E402
from sqlalchemy import create_engine, make_url  # noqa: E402

from sqlalchemy_pgtask import enqueue  # noqa: E402
from sqlalchemy_pgtask.dashboard import create_app  # noqa: E402
from sqlalchemy_pgtask.migrations import upgrade  # noqa: E402
from sqlalchemy_pgtask.testing import create_database, drop_database, provide_server  # noqa: E402
from tests.dashboard.conftest import CHROMIUM, CHROMIUM_ARGS, TOKEN, LiveServer  # noqa: E402
from tests.dashboard.seed import fail_task, seed  # noqa: E402

IMAGES = ROOT / "docs" / "images"
SHOTS = ("overview", "tasks", "task", "workers", "schedules", "audit")

TRACEBACK = """Traceback (most recent call last):
  File "/srv/app/tasks/invoices.py", line 88, in render_invoice
    pdf = renderer.render(template, order)
  File "/srv/app/pdf.py", line 31, in render
    raise RenderError(f"font {name!r} is not installed")
app.pdf.RenderError: font 'Inter-Bold' is not installed
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url")
    args = parser.parse_args()
    IMAGES.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        server_url = args.database_url or stack.enter_context(
            provide_server(url_env="PGTASK_TEST_DATABASE_URL")
        ).url
        raw = create_database(server_url, "pgtask_screenshots")
        stack.callback(drop_database, raw)
        url = make_url(raw).set(drivername="postgresql+psycopg")
        upgrade(url.render_as_string(hide_password=False))
        engine = create_engine(url)
        stack.callback(engine.dispose)
        seed(engine)
        with engine.begin() as connection:
            failed = enqueue(connection, "invoices.render", {"order": 1017, "locale": "de-DE"},
                             queue="default", idempotency_key="invoice-1017",
                             headers={"trace_id": "4bf92f3577b34da6"}).id
            fail_task(connection, failed, {
                "type": "handler_error", "exception": "app.pdf.RenderError",
                "message": "font 'Inter-Bold' is not installed", "traceback": TRACEBACK,
            })
        server = stack.enter_context(
            LiveServer(create_app(engine, admin_token=TOKEN, page_size=15))
        )
        playwright = stack.enter_context(sync_playwright())
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS)
        )
        stack.callback(browser.close)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(server.url + "/login")
        page.get_by_label("Your name").fill("alice")
        page.get_by_label("Admin token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()
        page.goto(server.url + "/")
        page.screenshot(path=str(IMAGES / "overview.png"))
        page.goto(server.url + "/tasks?queue=emails")
        page.screenshot(path=str(IMAGES / "tasks.png"))
        page.goto(f"{server.url}/tasks/{failed}")
        page.screenshot(path=str(IMAGES / "task.png"), full_page=True)
        for name in ("workers", "schedules", "audit"):
            page.goto(f"{server.url}/{name}")
            page.screenshot(path=str(IMAGES / f"{name}.png"))
    for name in SHOTS:
        print(IMAGES / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
