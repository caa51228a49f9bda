"""The task page's timeline in a real headless Chromium: a seeded workflow (a real worker's,
`tests.dashboard.workflow`) draws its attempts, steps, waits and child, styled by the
stylesheet under the strict Content-Security-Policy (no violation reported), says why each
attempt ended, and its child's bar is a link a click follows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import ConsoleMessage, Page, expect
from sqlalchemy import Engine

from sqlalchemy_pgtask.dashboard import create_app
from tests.dashboard.conftest import LiveServer
from tests.dashboard.workflow import BOOM, RESERVE, Workflow, run_workflow


@pytest.fixture
def workflow(pgtask_database_url: str, pgtask_engine: Engine) -> Workflow:
    return run_workflow(pgtask_database_url, pgtask_engine)


@pytest.fixture
def live(pgtask_engine: Engine, workflow: Workflow) -> Iterator[str]:
    with LiveServer(create_app(pgtask_engine)) as server:
        yield server.url


def fill_of(page: Page, selector: str) -> str:
    return str(page.locator(selector).first.evaluate("e => getComputedStyle(e).fill"))


def test_the_timeline_of_a_seeded_workflow(page: Page, live: str, workflow: Workflow) -> None:
    refused: list[str] = []

    def console(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            refused.append(message.text)

    page.on("console", console)
    page.goto(f"{live}/tasks/{workflow.parent}")

    drawing = page.get_by_test_id("timeline-drawing")
    expect(drawing).to_be_visible()
    expect(drawing.locator("rect.tl-attempt")).to_have_count(4)
    expect(drawing.locator("rect.tl-attempt.tl-failed")).to_have_count(1)
    expect(drawing.locator("rect.tl-attempt.tl-suspended")).to_have_count(3)
    expect(drawing.locator("circle.tl-kind-step")).to_have_count(1)
    expect(drawing.locator("circle.tl-kind-sleep")).to_have_count(1)
    expect(drawing.locator("rect.tl-sleep")).to_have_count(1)
    expect(drawing.locator("rect.tl-wait-child")).to_have_count(1)
    expect(drawing.locator("rect.tl-wait-signal")).to_have_count(1)
    expect(drawing.locator("text.tl-lane")).to_have_text(
        ["Attempts", "Steps", "Waits", "Children"]
    )
    # Tooltips hold user data as text.
    expect(drawing.locator("rect.tl-failed title")).to_contain_text(BOOM)
    expect(drawing.locator("circle.tl-kind-step title")).to_contain_text(RESERVE)
    # The stylesheet colours the shapes: a failed attempt in the "bad" colour (#b42318).
    assert fill_of(page, "svg.timeline rect.tl-failed") == "rgb(180, 35, 24)"
    box = drawing.bounding_box()
    assert box is not None
    assert box["width"] > 600

    endings = page.get_by_test_id("attempt-endings").locator("li")
    expect(endings).to_have_count(4)
    expect(endings.nth(0)).to_contain_text(f"with tests.dashboard.workflow.SeatTaken: {BOOM}")
    expect(endings.nth(1)).to_contain_text("suspended for a sleep at step cool-off #0 until")
    expect(endings.nth(2)).to_contain_text(f"waited for child {workflow.child}")
    expect(endings.nth(3)).to_contain_text("waiting for signal approval at step await-approval")
    expect(page.get_by_test_id("wait")).to_contain_text("signal approval at step")
    expect(page.get_by_test_id("explain").locator("li[data-code=waiting_signal]")).to_have_count(1)
    assert page.evaluate("() => window.__xss") is None

    drawing.locator("a rect.tl-child").click()

    page.wait_for_url(f"{live}/tasks/{workflow.child}")
    expect(page.get_by_test_id("attempt-endings")).to_contain_text(
        "waited for signal go at step await-go"
    )
    assert refused == []
