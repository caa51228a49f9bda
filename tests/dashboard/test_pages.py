"""The dashboard's pages against a real seeded database, through Starlette's test client:
each page shows what the database holds, the task list filters and pages without losing or
repeating a task, and user data is escaped everywhere.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import timedelta, timezone

import pytest
from sqlalchemy import Engine, select, text
from starlette.testclient import TestClient

from sqlalchemy_pgtask.models import Task
from tests.dashboard.conftest import Shared
from tests.dashboard.seed import BULK_TASKS, XSS_ERROR, XSS_PAYLOAD, Seeded

ROW_ID = re.compile(r'<tr data-task-id="([0-9a-f-]{36})">')


def listed(html: str) -> list[uuid.UUID]:
    return [uuid.UUID(found) for found in ROW_ID.findall(html)]


def all_ids_newest_first(engine: Engine) -> list[uuid.UUID]:
    """Every task id, newest first: by creation, ties by id."""
    with engine.connect() as connection:
        return list(connection.scalars(
            select(Task.id).order_by(Task.created_at.desc(), Task.id.desc())
        ))


def test_overview_shows_each_queue_with_counts_pause_capacity_rate_and_last_hour(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    page = shared_client_for().get("/")

    assert page.status_code == 200
    emails = re.search(r'<tr data-queue="emails">(.*?)</tr>', page.text, re.S)
    reports = re.search(r'<tr data-queue="reports">(.*?)</tr>', page.text, re.S)
    assert emails is not None
    assert reports is not None
    cells = re.findall(r"<td[^>]*>(.*?)</td>", emails.group(1), re.S)
    # pending (due), running, waiting, succeeded, failed, cancelled, last hour, failure rate
    assert [c.strip() for c in cells[1:9]] == [
        f"{BULK_TASKS - 5} ({BULK_TASKS - 5})", "1", "0", "4", "1", "0", "5", "20.0%",
    ]
    assert "/ 10000" in emails.group(1)
    assert "50 per 1.0 s" in emails.group(1)
    assert 'data-testid="paused"' in reports.group(1)
    assert 'data-testid="paused"' not in emails.group(1)
    assert "1 live worker." in page.text


def test_every_page_answers_and_shows_its_data(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    client = shared_client_for()

    workers = client.get("/workers")
    schedules = client.get("/schedules")
    audit = client.get("/audit")
    detail = client.get(f"/tasks/{shared.seeded.parent}")

    assert workers.status_code == schedules.status_code == audit.status_code == 200
    assert "worker-1.internal" in workers.text
    assert str(shared.seeded.running) in workers.text
    assert "reports: reports.build v1" in workers.text
    assert "nightly-report" in schedules.text
    assert schedules.text.count("<time") >= 5  # the next occurrences
    assert "alice" in audit.text
    assert "month-end freeze" in audit.text
    assert detail.status_code == 200
    assert all(str(child) in detail.text for child in shared.seeded.children)
    child = client.get(f"/tasks/{shared.seeded.children[0]}")
    assert str(shared.seeded.parent) in child.text  # its parent, in the family tree


def test_failed_task_shows_attempt_error_and_traceback(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    page = shared_client_for().get(f"/tasks/{shared.seeded.failed}")

    assert page.status_code == 200
    assert "smtplib.SMTPDataError" in page.text
    assert "Traceback (most recent call last):" in page.text
    assert 'data-testid="attempts"' in page.text
    assert "order-xss" in page.text


def test_user_data_is_escaped_on_every_page_that_shows_it(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    client = shared_client_for()
    pages = [client.get(f"/tasks/{shared.seeded.failed}"), client.get("/tasks?q=order-xss")]

    detail = pages[0].text
    for raw in (XSS_PAYLOAD, XSS_ERROR, "<script>window.__xss", "<img src=x"):
        assert raw not in detail
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in detail
    assert "&lt;img src=x onerror=&#34;window.__xss=3&#34;&gt;" in detail
    assert all(page.status_code == 200 for page in pages)
    assert "script-src 'self'" in pages[0].headers["content-security-policy"]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=failed", lambda s: [s.failed]),
        ("queue=reports", lambda s: [s.pending]),
        # Newest first: the second child was enqueued later (ids made in one millisecond
        # are not ordered, so sorting the ids would be wrong half the time).
        ("name=orders.ship", lambda s: list(reversed(s.children))),
        ("q=order-xss&queue=emails", lambda s: [s.failed]),
        ("q={parent}", lambda s: [s.parent]),
        ("state=running&queue=emails", lambda s: [s.running]),
        ("state=failed&queue=reports", lambda s: []),
    ],
)
def test_task_list_filters(
    shared_client_for: Callable[..., TestClient],
    shared: Shared,
    query: str,
    expected: Callable[[Seeded], list[uuid.UUID]],
) -> None:
    page = shared_client_for().get("/tasks?" + query.format(parent=shared.seeded.parent))

    assert page.status_code == 200
    assert listed(page.text) == expected(shared.seeded)


def test_task_list_time_range_keeps_tasks_created_within_it(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    with shared.engine.connect() as connection:
        stamps = {r.id: r.created_at for r in connection.execute(select(Task.id, Task.created_at))}
    newest = max(stamps.values())
    since = (newest - timedelta(minutes=2, seconds=30)).astimezone(timezone.utc)
    local = since.replace(tzinfo=None).isoformat(timespec="seconds")  # a datetime-local field

    page = shared_client_for().get("/tasks", params={"since": local})

    expected = {i for i, at in stamps.items() if at >= since.replace(microsecond=0)}
    assert set(listed(page.text)) == expected
    assert len(expected) == 3
    until = shared_client_for().get("/tasks", params={"until": newest.isoformat(), "since": local})
    assert set(listed(until.text)) == expected - {i for i, at in stamps.items() if at == newest}


def test_pages_walk_every_task_once_newest_first(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    client = shared_client_for(page_size=20)
    seen: list[uuid.UUID] = []
    url: str | None = "/tasks"
    pages = 0
    while url is not None:
        page = client.get(url)
        assert page.status_code == 200
        seen.extend(listed(page.text))
        pages += 1
        found = re.search(r'<a href="([^"]+)" rel="next"', page.text)
        url = found.group(1).replace("&amp;", "&") if found else None

    assert seen == all_ids_newest_first(shared.engine)
    assert pages == -(-len(seen) // 20)


@pytest.mark.parametrize(
    "path",
    [
        "/tasks?state=finished",
        "/tasks?after=yesterday",
        "/tasks?since=soon",
        "/tasks?limit=0",
        "/tasks?queue=bad%20queue%20name%00",
        "/tasks/not-a-uuid",
        "/audit?before=x",
        "/audit?before=99999999999999999999",
        # Digits to str.isdigit() that int() refuses: these were a 500.
        "/tasks?limit=%C2%B2",
        "/audit?limit=%C2%B2",
        "/audit?before=1%C2%B2",
    ],
)
def test_bad_input_is_a_400_page(
    shared_client_for: Callable[..., TestClient], shared: Shared, path: str
) -> None:
    page = shared_client_for().get(path)

    assert page.status_code == 400
    assert 'data-testid="error"' in page.text


def test_unknown_task_is_a_404_page(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    missing = uuid.uuid4()

    page = shared_client_for().get(f"/tasks/{missing}")

    assert page.status_code == 404
    assert f"no task with id {missing}" in page.text


def test_database_without_the_schema_is_a_503_page(empty_engine: Engine) -> None:
    from sqlalchemy_pgtask.dashboard import create_app

    with TestClient(create_app(empty_engine)) as client:
        page = client.get("/")

    assert page.status_code == 503
    assert "schema" in page.text


def test_audit_log_pages_by_entry_id(
    shared_client_for: Callable[..., TestClient], shared: Shared
) -> None:
    client = shared_client_for(page_size=1)
    first = client.get("/audit")
    found = re.search(r'<a href="([^"]+)" rel="next"', first.text)
    assert found is not None

    second = client.get(found.group(1).replace("&amp;", "&"))

    ids = [re.findall(r'<td class="num">(\d+)</td>', p.text) for p in (first, second)]
    assert len(ids[0]) == len(ids[1]) == 1
    assert int(ids[1][0]) < int(ids[0][0])


def test_create_app_refuses_bad_options(shared: Shared) -> None:
    from sqlalchemy_pgtask.dashboard import create_app

    with pytest.raises(ValueError, match="page_size"):
        create_app(shared.engine, page_size=0)
    with pytest.raises(ValueError, match="admin_token"):
        create_app(shared.engine, admin_token="short")
    with pytest.raises(ValueError, match="PostgreSQL"):
        create_app("sqlite:///x.db")



def test_a_page_whose_query_runs_too_long_is_cancelled_and_says_so(
    shared_client_for: Callable[..., TestClient], shared: Shared,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sqlalchemy_pgtask.dashboard._base._READ_TIMEOUT_MS", "200")
    client = shared_client_for()
    # Another transaction's lock makes the page's query wait: waiting counts as running.
    with shared.engine.connect() as locker, locker.begin():
        locker.execute(text("LOCK TABLE pgtask.tasks IN ACCESS EXCLUSIVE MODE"))
        page = client.get("/tasks?state=failed")

    assert page.status_code == 503
    assert "was cancelled" in page.text
    assert client.get("/tasks?state=failed").status_code == 200
