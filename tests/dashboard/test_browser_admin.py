"""The dashboard's admin features in a real headless Chromium (Debian's): a bulk retry of the
filtered task list clicked through its confirmation, and a schedule paused, resumed and run
now from the schedules page, each time shown with its zone; no page runs script or inline style.
"""

from __future__ import annotations

from playwright.sync_api import ConsoleMessage, Page, expect
from sqlalchemy import Engine, select

from sqlalchemy_pgtask import get_schedule
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.models import Task
from tests.dashboard.conftest import TOKEN
from tests.dashboard.seed import Seeded, fail_task


def _log_in(tab: Page, live: str) -> None:
    tab.goto(live + "/login")
    tab.get_by_label("Your name").fill("grace")
    tab.get_by_label("Admin token").fill(TOKEN)
    tab.get_by_role("button", name="Log in").click()
    expect(tab.get_by_test_id("actor")).to_have_text("dashboard:grace")


def _csp_violations(tab: Page) -> list[str]:
    seen: list[str] = []

    def note(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            seen.append(message.text)

    tab.on("console", note)
    return seen


def test_bulk_retry_of_the_filtered_list_is_clicked_through_its_confirmation(
    page: Page, live: str, seeded: Seeded, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as connection:
        more = list(connection.execute(
            select(Task.id).where(Task.queue == "emails", Task.state == "pending")
            .order_by(Task.id).limit(2)
        ).scalars())
        for task_id in more:
            fail_task(connection, task_id, {"type": "handler_error", "message": "boom"})
    violations = _csp_violations(page)
    _log_in(page, live)
    page.goto(live + "/tasks")
    page.get_by_label("State").select_option("failed")
    page.get_by_label("Queue").fill("emails")
    page.get_by_role("button", name="Filter").click()

    page.get_by_role("button", name="Retry all matching…").click()

    expect(page.get_by_test_id("bulk-count")).to_contain_text("3 tasks will be retried.")
    expect(page.get_by_test_id("bulk-filter")).to_contain_text("emails")
    expect(page.get_by_test_id("bulk-filter")).to_contain_text("failed")
    page.get_by_label("Reason").fill("smtp back")
    page.get_by_role("button", name="Retry 3 tasks").click()

    expect(page.get_by_test_id("bulk-result")).to_contain_text("3 tasks retried")
    with pgtask_engine.connect() as connection:
        states = set(connection.execute(
            select(Task.state).where(Task.id.in_([*more, seeded.failed]))
        ).scalars())
        entries = [e for e in list_audit(connection, limit=50) if e.action == "task.retry"]
    assert states == {"pending"}
    assert len(entries) == 3
    assert {(e.actor, e.reason) for e in entries} == {("dashboard:grace", "smtp back")}
    page.get_by_test_id("bulk-back").click()
    expect(page.get_by_test_id("empty")).to_be_visible()  # no failed email task is left
    assert violations == []


def test_a_schedule_is_paused_resumed_and_run_now_from_its_page_with_times_in_its_zone(
    page: Page, live: str, seeded: Seeded, pgtask_engine: Engine
) -> None:
    violations = _csp_violations(page)
    _log_in(page, live)
    page.goto(live + "/schedules")
    row = page.locator("tr[data-schedule=nightly-report]")
    expect(row.get_by_test_id("timezone")).to_have_text("UTC")
    expect(row.get_by_test_id("upcoming").locator("time").first).to_contain_text("03:00:00 UTC")

    row.get_by_role("button", name="Pause").click()
    expect(page.get_by_role("status")).to_contain_text("The schedule is paused")
    with pgtask_engine.connect() as connection:
        paused = get_schedule(connection, "nightly-report")
    row.get_by_role("button", name="Resume").click()
    expect(page.get_by_role("status")).to_contain_text("The schedule is resumed")
    row.get_by_role("button", name="Run now").click()
    expect(page.get_by_role("status")).to_contain_text("One occurrence was enqueued now")

    assert paused is not None
    assert paused.paused
    with pgtask_engine.connect() as connection:
        entries = list_audit(connection, schedule="nightly-report", limit=5)
    assert [(e.action, e.actor) for e in entries][:3] == [
        ("schedule.run_now", "dashboard:grace"), ("schedule.resume", "dashboard:grace"),
        ("schedule.pause", "dashboard:grace"),
    ]
    assert violations == []
