"""The dashboard in a real headless Chromium: every page loads against a seeded database, the
task list filters and pages, an operator opens a task and cancels and retries it with the
token, a request without it is refused, and script in user data never runs.
"""

from __future__ import annotations

from playwright.sync_api import Page, expect
from sqlalchemy import Engine, func, select

from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.models import Task
from sqlalchemy_pgtask.status import task_summary
from tests.dashboard.conftest import TOKEN, snapshot
from tests.dashboard.seed import XSS_ERROR, XSS_PAYLOAD, Seeded


def xss_ran(page: Page) -> object:
    return page.evaluate("() => window.__xss")


def test_every_page_loads_and_script_in_user_data_stays_text(
    page: Page, live: str, seeded: Seeded
) -> None:
    for path, heading in [
        ("/", "Queues"), ("/tasks", "Tasks"), ("/workers", "Workers"),
        ("/schedules", "Schedules"), ("/audit", "Audit log"),
    ]:
        answer = page.goto(live + path)
        assert answer is not None
        assert answer.status == 200
        expect(page.locator("h1")).to_have_text(heading)
    expect(page.locator("table[data-testid=audit]")).to_contain_text("month-end freeze")

    page.goto(f"{live}/tasks/{seeded.failed}")

    expect(page.get_by_test_id("payload")).to_contain_text(XSS_PAYLOAD.replace('"', '\\"'))
    expect(page.get_by_test_id("error-message")).to_contain_text(XSS_ERROR)
    assert page.locator("main script").count() == 0
    assert page.locator("main img").count() == 0
    assert xss_ran(page) is None


def test_filter_then_page_through_the_task_list(
    page: Page, live: str, seeded: Seeded, pgtask_engine: Engine
) -> None:
    page.goto(live + "/tasks")
    page.get_by_label("State").select_option("failed")
    page.get_by_role("button", name="Filter").click()

    expect(page.locator("tr[data-task-id]")).to_have_count(1)
    assert page.locator("tr[data-task-id]").get_attribute("data-task-id") == str(seeded.failed)
    assert "state=failed" in page.url

    page.get_by_role("link", name="Clear").click()
    page.get_by_label("Queue").fill("emails")
    page.get_by_role("button", name="Filter").click()
    seen: list[str] = []
    while True:
        rows = page.locator("tr[data-task-id]")
        seen.extend(rows.evaluate_all("rows => rows.map(r => r.dataset.taskId)"))
        following = page.get_by_test_id("next")
        if following.count() == 0:
            break
        following.click()
        expect(page.get_by_test_id("first")).to_be_visible()

    with pgtask_engine.connect() as connection:
        expected = connection.scalar(
            select(func.count()).select_from(Task).where(Task.queue == "emails")
        )
    assert len(seen) == expected
    assert len(set(seen)) == len(seen)
    assert xss_ran(page) is None


def test_open_a_task_then_cancel_and_retry_it_with_the_token(
    page: Page, live: str, seeded: Seeded, pgtask_engine: Engine
) -> None:
    page.goto(live + "/")
    page.get_by_role("link", name="Log in").click()
    page.get_by_label("Your name").fill("frank")
    page.get_by_label("Admin token").fill(TOKEN)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_test_id("actor")).to_have_text("dashboard:frank")

    page.goto(live + "/tasks?queue=reports")
    page.get_by_role("link", name="reports.build").click()
    expect(page.get_by_test_id("task-id")).to_have_text(str(seeded.pending))
    page.get_by_placeholder("reason (optional)").fill("wrong month")
    page.get_by_role("button", name="Cancel").click()
    expect(page.get_by_role("status")).to_have_text("The task was cancelled.")
    expect(page.locator("h1 .state")).to_have_text("cancelled")

    page.get_by_role("button", name="Retry").click()
    expect(page.get_by_role("status")).to_have_text("The task will run again.")
    expect(page.locator("h1 .state")).to_have_text("pending")
    expect(page.get_by_test_id("task-audit")).to_contain_text("dashboard:frank")

    with pgtask_engine.connect() as connection:
        entries = list_audit(connection, task_id=seeded.pending)
        summary = task_summary(connection, seeded.pending)
    assert [(e.action, e.actor, e.reason) for e in entries] == [
        ("task.retry", "dashboard:frank", None),
        ("task.cancel", "dashboard:frank", "wrong month"),
    ]
    assert summary is not None
    assert summary.state == "pending"


def test_without_the_token_there_is_no_action_and_a_forged_post_is_refused(
    page: Page, live: str, seeded: Seeded, pgtask_engine: Engine
) -> None:
    page.goto(f"{live}/tasks/{seeded.failed}")
    expect(page.get_by_text("to retry or cancel")).to_be_visible()
    assert page.get_by_role("button", name="Retry").count() == 0
    before = snapshot(pgtask_engine)
    cookie = next(c for c in page.context.cookies() if c["name"] == "pgtask_csrf")

    answer = page.request.post(
        f"{live}/tasks/{seeded.failed}/retry", form={"csrf_token": cookie["value"]}
    )

    assert answer.status == 403
    assert "needs the admin token" in answer.text()
    assert snapshot(pgtask_engine) == before
