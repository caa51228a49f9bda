"""The task list's search by payload (`sqlalchemy_pgtask.dashboard._payload`), over HTTP on a
real seeded database: JSON containment finds exactly the matching tasks, combines with the
other filters, is bounded by ``scan_limit`` like them (and pages on to older matches), and
anything but a small JSON object is a 400 that names the field, before any SQL.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import event
from starlette.testclient import TestClient

from sqlalchemy_pgtask.dashboard._payload import (
    PAYLOAD_FILTER_MAX_BYTES,
    parse_payload_filter,
)
from sqlalchemy_pgtask.dashboard._task_list import TaskFilters
from sqlalchemy_pgtask.errors import InvalidOptionError
from tests.dashboard.conftest import Shared
from tests.dashboard.seed import BULK_TASKS, Seeded

ROW_ID = re.compile(r'<tr data-task-id="([0-9a-f-]{36})">')
Apps = Callable[..., TestClient]


def listed(html: str) -> set[uuid.UUID]:
    return {uuid.UUID(found) for found in ROW_ID.findall(html)}


def search(client: TestClient, payload: str, **params: str) -> str:
    answer = client.get("/tasks", params={"payload": payload, **params})
    assert answer.status_code == 200, answer.text
    return answer.text


def test_containment_finds_exactly_the_matching_tasks(
    shared_client_for: Apps, shared: Shared
) -> None:
    seeded: Seeded = shared.seeded
    client = shared_client_for()

    assert listed(search(client, '{"order": 1017}')) == {seeded.parent, *seeded.children}
    assert listed(search(client, '{"order": 1017, "parcel": 2}')) == {seeded.children[1]}
    assert listed(search(client, '{"order": 1018}')) == set()
    assert listed(search(client, '{"month": "2026-11"}', queue="reports")) == {seeded.pending}
    assert listed(search(client, '{"order": 1017}', queue="emails")) == set()
    welcome = listed(search(client, '{"kind": "welcome"}', limit="100"))
    assert len(welcome) == BULK_TASKS


def test_the_form_shows_the_filter_back_escaped(shared_client_for: Apps, shared: Shared) -> None:
    page = search(shared_client_for(), '{"order": 1017, "note": "<b>"}')
    assert 'name="payload" value="{&#34;order&#34;: 1017, &#34;note&#34;: &#34;&lt;b&gt;&#34;}"' \
        in page


def test_the_search_reads_at_most_scan_limit_tasks_then_pages_on(
    shared_client_for: Apps, shared: Shared
) -> None:
    """The oldest seeded task is found by following "search older" pages of 5 tasks read."""
    client = shared_client_for(page_size=5, scan_limit=5)
    url = "/tasks?" + "payload=" + json.dumps({"to": "user0@example.com"})
    pages = 0
    while True:
        pages += 1
        page = client.get(url)
        assert page.status_code == 200
        found = listed(page.text)
        if found:
            break
        assert 'data-testid="searched"' in page.text
        url = re.search(r'<a href="([^"]+)">search older', page.text).group(1)  # type: ignore[union-attr]
        url = url.replace("&amp;", "&")
    assert found == {shared.seeded.succeeded}
    assert pages > 1


def test_one_range_of_the_created_index_is_read(shared: Shared) -> None:
    """The page's statements: the floor of the range, then the filtered range with ``@>``."""
    from sqlalchemy_pgtask.dashboard._task_list import task_page

    statements: list[str] = []
    with shared.engine.connect() as connection:
        event.listen(connection, "before_cursor_execute",
                     lambda *args: statements.append(args[2]))
        filters = TaskFilters(payload=parse_payload_filter('{"order": 1017}'))
        page = task_page(connection, filters, limit=10, scan_limit=20)
    assert len(page.tasks) == 3
    assert len(statements) == 2
    assert "OFFSET" in statements[0]
    assert "@>" in statements[1]


@pytest.mark.parametrize(("raw", "problem"), [
    ("[1]", "must be a JSON object"),
    ("42", "must be a JSON object"),
    ('"order"', "must be a JSON object"),
    ("null", "must be a JSON object"),
    ("{}", "matches every task"),
    ("{order: 1}", "is not JSON"),
    ('{"a": NaN}', "is not JSON"),
    ('{"a": 1e999}', "payload"),
    ('{"a": "\\u0000"}', "NUL"),
    ('{"a": "\\ud800"}', "surrogate"),
    ('{"a": "' + "x" * PAYLOAD_FILTER_MAX_BYTES + '"}', "the limit is 2048"),
    ("[" * 1500 + "]" * 1500, "payload"),
])
def test_anything_but_a_small_json_object_is_a_400_before_any_sql(
    shared_client_for: Apps, raw: str, problem: str
) -> None:
    with pytest.raises(InvalidOptionError, match=problem):
        parse_payload_filter(raw)
    answer = shared_client_for().get("/tasks", params={"payload": raw})
    assert answer.status_code == 400
    assert "payload" in answer.text


def test_an_empty_field_is_no_filter(shared_client_for: Apps, shared: Shared) -> None:
    assert parse_payload_filter("  ") is None
    page = shared_client_for().get("/tasks", params={"payload": ""})
    assert page.status_code == 200
    assert len(listed(page.text)) == 50


def test_task_filters_take_only_a_checked_filter() -> None:
    with pytest.raises(InvalidOptionError, match="payload"):
        TaskFilters(payload={"order": 1})  # type: ignore[arg-type]
