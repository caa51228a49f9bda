"""Live refresh (`sqlalchemy_pgtask.dashboard._live`): with the fragment header, the overview,
the task list and a task's page answer their live region alone, from the database as it is
now; without it, the full page, which works without the script; the interval is checked and
0 turns the script off; a fragment request for a page that needs a login gets no fragment.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Engine, update
from starlette.testclient import TestClient

from sqlalchemy_pgtask.cli import main as cli_main
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._live import FRAGMENT_HEADER
from sqlalchemy_pgtask.models import Task
from tests.dashboard.conftest import TOKEN
from tests.dashboard.seed import Seeded

LIVE = {FRAGMENT_HEADER: "live"}
Apps = Callable[..., TestClient]


@pytest.mark.parametrize("path", ["/", "/tasks", "/tasks?state=failed", "task"])
def test_the_fragment_is_the_live_region_alone(
    client_for: Apps, seeded: Seeded, path: str
) -> None:
    client = client_for()
    path = f"/tasks/{seeded.failed}" if path == "task" else path
    full = client.get(path)
    fragment = client.get(path, headers=LIVE)

    assert full.status_code == fragment.status_code == 200
    assert "<html" in full.text
    assert 'data-live data-testid="live-region"' in full.text
    assert "<html" not in fragment.text
    assert "<header" not in fragment.text
    assert "data-live" not in fragment.text
    assert fragment.headers[FRAGMENT_HEADER] == "live"
    assert FRAGMENT_HEADER not in full.headers
    assert fragment.headers["vary"].lower() == full.headers["vary"].lower() == FRAGMENT_HEADER
    assert fragment.headers["cache-control"] == "no-store"
    assert "script-src 'self';" in fragment.headers["content-security-policy"]
    # The region is the same markup in both answers.
    assert fragment.text.strip() in full.text


def test_a_fragment_shows_what_changed_since_the_page_loaded(
    client_for: Apps, seeded: Seeded, pgtask_engine: Engine
) -> None:
    client = client_for()
    before = client.get(f"/tasks/{seeded.pending}", headers=LIVE).text
    assert "state-pending" in before
    with pgtask_engine.begin() as connection:
        connection.execute(update(Task).where(Task.id == seeded.pending).values(
            state="cancelled", completed_at=Task.updated_at
        ))

    after = client.get(f"/tasks/{seeded.pending}", headers=LIVE).text

    assert "state-cancelled" in after
    assert "state-pending" not in after


def test_pages_without_a_live_region_answer_in_full(client_for: Apps, seeded: Seeded) -> None:
    client = client_for()
    for path in ("/workers", "/schedules", "/audit", "/tasks/not-a-task-id"):
        answer = client.get(path, headers=LIVE)
        assert "<html" in answer.text
        assert FRAGMENT_HEADER not in answer.headers


def test_the_page_loads_the_script_with_its_interval_and_not_when_off(
    client_for: Apps, seeded: Seeded
) -> None:
    page = client_for(live_interval=12).get("/").text
    assert 'data-live-interval="12.0"' in page
    assert '<script src="/static/live.js" defer></script>' in page
    assert "<script>" not in page  # never inline script

    off = client_for(live_interval=0).get("/").text
    assert "live.js" not in off

    script = client_for().get("/static/live.js")
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    assert "X-Pgtask-Fragment" in script.text


@pytest.mark.parametrize("bad", [0.5, 3601, -1, float("nan"), "5", True])
def test_a_bad_live_interval_is_refused(pgtask_engine: Engine, bad: object) -> None:
    with pytest.raises(ValueError, match="live_interval"):
        create_app(pgtask_engine, live_interval=bad)  # type: ignore[arg-type]


def test_the_command_refuses_a_bad_live_interval(
    pgtask_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["dashboard", "--database-url", pgtask_database_url,
                  "--live-interval", "0.2", "--port", "1"])
    assert exited.value.code == 2
    assert "live_interval must be 0 (off) or 1 to 3600 seconds" in capsys.readouterr().err


def test_a_fragment_request_that_needs_a_login_gets_no_fragment(
    client_for: Apps, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN, require_login=True)
    answer = client.get("/", headers=LIVE)
    assert answer.status_code == 303
    assert FRAGMENT_HEADER not in answer.headers
