"""The dashboard's issue-27 features in a real headless Chromium (Debian's): live refresh
changes a count on the open page without a reload and stops when toggled off; the per-queue
charts render with the seeded counts; the search by payload finds its task.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import Engine

from sqlalchemy_pgtask import cancel, enqueue
from sqlalchemy_pgtask.dashboard import create_app
from tests.dashboard.conftest import LiveServer
from tests.dashboard.seed import Seeded


@pytest.fixture
def fast(pgtask_engine: Engine, seeded: Seeded) -> Iterator[str]:
    """The seeded dashboard refreshing every second; its base URL."""
    with LiveServer(create_app(pgtask_engine, live_interval=1)) as server:
        yield server.url


def pending_cell(page: Page) -> str:
    return page.locator("tr[data-queue=reports] td").nth(1).inner_text()


def test_live_refresh_updates_a_changed_count_without_a_reload(
    page: Page, fast: str, pgtask_engine: Engine
) -> None:
    page.goto(fast + "/")
    expect(page.get_by_test_id("live-toggle")).to_have_text("Live: on")
    before = pending_cell(page)
    assert before.startswith("1 ")
    page.evaluate("() => { window.__loaded_once = true; }")

    with pgtask_engine.begin() as connection:
        for month in ("2026-12", "2027-01"):
            enqueue(connection, "reports.build", {"month": month}, queue="reports")

    expect(page.locator("tr[data-queue=reports] td").nth(1)).to_have_text("3 (3)")
    assert page.evaluate("() => window.__loaded_once") is True  # the same document

    page.get_by_test_id("live-toggle").click()
    expect(page.get_by_test_id("live-toggle")).to_have_attribute("aria-pressed", "false")
    expect(page.get_by_test_id("live-region")).to_have_attribute("data-live-state", "off")
    # The choice is the browser's: a reload keeps it off.
    page.reload()
    expect(page.get_by_test_id("live-toggle")).to_have_text("Live: off")


def test_the_task_list_refreshes_a_task_state_in_place(
    page: Page, fast: str, seeded: Seeded, pgtask_engine: Engine
) -> None:
    page.goto(fast + "/tasks?queue=reports")
    row = page.locator(f"tr[data-task-id='{seeded.pending}'] .state")
    expect(row).to_have_text("pending")
    page.evaluate("() => { window.__loaded_once = true; }")

    with pgtask_engine.begin() as connection:
        cancel(connection, seeded.pending, actor="test")

    expect(row).to_have_text("cancelled")
    assert page.evaluate("() => window.__loaded_once") is True


def test_search_by_payload_finds_the_task(page: Page, fast: str, seeded: Seeded) -> None:
    page.goto(fast + "/tasks")
    page.get_by_label("Payload contains").fill('{"order": 1017, "parcel": 2}')
    page.get_by_role("button", name="Filter").click()

    expect(page.locator("tr[data-task-id]")).to_have_count(1)
    assert page.locator("tr[data-task-id]").get_attribute("data-task-id") == str(
        seeded.children[1]
    )
    expect(page.get_by_label("Payload contains")).to_have_value('{"order": 1017, "parcel": 2}')

    page.get_by_label("Payload contains").fill("[1017]")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("main")).to_contain_text("must be a JSON object")


def test_the_charts_render_with_the_seeded_counts(page: Page, fast: str, seeded: Seeded) -> None:
    page.goto(fast + "/")
    row = page.locator("tr[data-chart-queue=emails]")
    finished = row.locator("svg.chart-finished")
    expect(finished).to_be_visible()
    expect(finished).to_have_attribute("data-total", "5")
    expect(row.locator("svg.chart-failed")).to_have_attribute("data-total", "1")
    box = finished.bounding_box()
    assert box is not None
    assert box["width"] > 100
    assert box["height"] > 20
    assert finished.locator("rect").count() >= 1

    page.get_by_test_id("chart-day").click()
    expect(page.get_by_test_id("charts")).to_have_attribute("data-window", "day")
    expect(page.locator("tr[data-chart-queue=emails] svg.chart-finished")).to_have_attribute(
        "data-total", "5"
    )
