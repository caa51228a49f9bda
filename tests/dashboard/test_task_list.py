"""The dashboard's task list read: newest first by creation, keyset pages that never repeat or
skip a task, and bounded reads, so a filter that matches few tasks or none answers after at
most ``scan_limit`` tasks read, says how far back it looked, and goes on from there.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, delete, event, select, text
from starlette.testclient import TestClient

from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.dashboard._task_list import TaskFilters, TaskPage, task_page
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import Task
from tests.dashboard.conftest import Shared
from tests.dashboard.seed import Seeded

FILTERS = [
    pytest.param(TaskFilters(state="succeeded"), id="state=succeeded"),
    pytest.param(TaskFilters(name="orders.ship"), id="name=orders.ship"),
    pytest.param(TaskFilters(queue="reports"), id="queue=reports"),
    pytest.param(TaskFilters(queue="emails", state="pending"), id="queue=emails&state=pending"),
    pytest.param(TaskFilters(queue="reports", state="failed"), id="no match"),
    pytest.param(TaskFilters(), id="no filter"),
]


def matching(connection: Connection, filters: TaskFilters) -> list[uuid.UUID]:
    """What the list must show, page after page: every match, newest first."""
    statement = select(Task.id).order_by(Task.created_at.desc(), Task.id.desc())
    for column in ("state", "queue", "name"):
        value = getattr(filters, column)
        if value is not None:
            statement = statement.where(getattr(Task, column) == value)
    return list(connection.scalars(statement))


def walk(connection: Connection, filters: TaskFilters, **options: Any) -> list[TaskPage]:
    pages = [task_page(connection, filters, **options)]
    while pages[-1].next_cursor is not None:
        assert len(pages) < 200, "the pages never end"
        pages.append(task_page(connection, filters, after=pages[-1].next_cursor, **options))
    return pages


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize(("limit", "scan_limit"), [(2, 7), (5, 5), (50, 50_000)])
def test_pages_of_bounded_reads_list_every_match_once_newest_first(
    shared: Shared, filters: TaskFilters, limit: int, scan_limit: int
) -> None:
    with shared.engine.connect() as connection:
        pages = walk(connection, filters, limit=limit, scan_limit=scan_limit)
        expected = matching(connection, filters)

    assert [task.id for page in pages for task in page.tasks] == expected
    assert all(len(page.tasks) <= limit for page in pages)
    assert pages[-1].next_cursor is None


def test_a_filter_that_matches_nothing_stops_at_the_scan_limit_and_says_how_far_it_looked(
    shared: Shared,
) -> None:
    with shared.engine.connect() as connection:
        newest = list(connection.execute(
            select(Task.id, Task.created_at).order_by(Task.created_at.desc(), Task.id.desc())
        ))
        pages = walk(connection, TaskFilters(name="no.such.task"), limit=3, scan_limit=10)

    assert all(page.tasks == () for page in pages)
    # Each page read the next ten tasks; a page whose ten reach the oldest task is the last.
    floors = [newest[i].created_at for i in range(9, len(newest) - 1, 10)]
    assert [page.searched_to for page in pages[:-1]] == floors
    assert len(pages) == len(floors) + 1
    assert pages[-1].searched_to is None


@pytest.mark.parametrize("extra", [0, 1])
def test_a_read_that_reaches_the_oldest_task_ends_the_list_without_an_empty_page(
    shared: Shared, extra: int
) -> None:
    with shared.engine.connect() as connection:
        total = len(matching(connection, TaskFilters()))
        page = task_page(
            connection, TaskFilters(name="no.such.task"), scan_limit=total + extra
        )

    assert page.tasks == ()
    assert page.next_cursor is None
    assert page.searched_to is None


def test_one_task_short_of_the_oldest_the_read_stops_and_offers_the_rest(shared: Shared) -> None:
    with shared.engine.connect() as connection:
        everything = matching(connection, TaskFilters())
        page = task_page(
            connection, TaskFilters(name="no.such.task"), scan_limit=len(everything) - 1
        )
        rest = task_page(connection, TaskFilters(), limit=5, after=page.next_cursor)

    assert page.next_cursor is not None
    assert [task.id for task in rest.tasks] == everything[-1:]


def test_a_page_that_finds_a_full_page_before_the_scan_limit_is_not_marked_searched(
    shared: Shared,
) -> None:
    with shared.engine.connect() as connection:
        page = task_page(connection, TaskFilters(queue="emails"), limit=3, scan_limit=10)

    assert len(page.tasks) == 3
    assert page.searched_to is None
    assert page.next_cursor is not None


def test_a_bare_task_id_as_cursor_continues_below_that_task(shared: Shared) -> None:
    with shared.engine.connect() as connection:
        everything = matching(connection, TaskFilters())
        page = task_page(connection, TaskFilters(), limit=3, after=str(everything[4]))

    assert [task.id for task in page.tasks] == everything[5:8]


def test_a_cursor_outlives_the_task_it_points_below(pgtask_engine: Engine, seeded: Seeded) -> None:
    with pgtask_engine.connect() as connection:
        first = task_page(connection, TaskFilters(), limit=3)
        expected = matching(connection, TaskFilters())[3:6]
    assert first.next_cursor is not None
    with pgtask_engine.begin() as connection:
        # Retention may delete the last task of a page between two page views.
        connection.execute(delete(Task).where(Task.id == first.tasks[-1].id))

    with pgtask_engine.connect() as connection:
        second = task_page(connection, TaskFilters(), limit=3, after=first.next_cursor)

    assert [task.id for task in second.tasks] == expected


@pytest.mark.parametrize(
    "cursor", ["yesterday", "12.not-a-uuid", "x.0190c1e2-0000-7000-8000-000000000000", ".", ""]
)
def test_a_malformed_cursor_is_an_invalid_option(shared: Shared, cursor: str) -> None:
    with shared.engine.connect() as connection, pytest.raises(InvalidOptionError) as caught:
        task_page(connection, TaskFilters(), after=cursor)
    assert caught.value.field == "after"


def test_a_cursor_naming_a_missing_task_is_an_invalid_option(shared: Shared) -> None:
    with shared.engine.connect() as connection, pytest.raises(InvalidOptionError) as caught:
        task_page(connection, TaskFilters(), after=str(uuid.uuid4()))
    assert "no task with id" in caught.value.reason


def test_the_page_says_where_it_stopped_and_links_to_older_tasks(
    shared_client_for: Callable[..., TestClient],
) -> None:
    client = shared_client_for(page_size=5, scan_limit=10)
    url: str | None = "/tasks?name=no.such.task"
    notices = 0
    while url is not None:
        page = client.get(url)
        assert page.status_code == 200
        found = re.search(r'<a href="([^"]+)" rel="next"', page.text)
        url = found.group(1).replace("&amp;", "&") if found else None
        if url is not None:
            assert 'data-testid="searched"' in page.text
            assert "No task matches among" in page.text
            assert 'data-testid="empty"' not in page.text
            notices += 1

    assert notices >= 1
    # The last window held fewer than ten tasks: the end of the list, said plainly.
    assert 'data-testid="empty"' in page.text
    assert 'data-testid="searched"' not in page.text


def test_a_scan_limit_below_the_page_size_is_refused(shared: Shared) -> None:
    with pytest.raises(ValueError, match="scan_limit"):
        create_app(shared.engine, page_size=50, scan_limit=49)


def test_a_filtered_page_walks_the_created_index_and_stops_at_the_scan_limit(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO pgtask.tasks (queue, name, payload, created_at) "
            "SELECT 'q' || (i % 10), 'task-' || (i % 20), '{}', "
            "statement_timestamp() - make_interval(secs => i) "
            "FROM generate_series(1, 20000) AS i"
        ))
    with pgtask_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text("ANALYZE pgtask.tasks"))

    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        captured.append((statement, params))

    with pgtask_engine.connect() as connection:
        event.listen(connection, "before_cursor_execute", capture)
        page = task_page(connection, TaskFilters(queue="q3", name="nothing"), scan_limit=1000)
        event.remove(connection, "before_cursor_execute", capture)
        plans = [
            "\n".join(connection.exec_driver_sql(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + statement, params
            ).scalars())
            for statement, params in captured
        ]

    assert page.tasks == ()
    assert page.searched_to is not None
    # Two statements: the floor of the range (the scan limit's worth of index entries, and one
    # more to know whether older tasks exist), then the filtered read of that range.
    assert len(plans) == 2
    floor, read = plans
    assert "Index Only Scan Backward using ix_tasks_created" in floor, floor
    for plan in plans:
        assert "Seq Scan" not in plan, plan
        assert "ix_tasks_created" in plan, plan
        # Never more than the range: not the 20,000 rows of the table.
        examined = [int(n) for n in re.findall(r"(?:actual rows=|Removed by Filter: )(\d+)", plan)]
        assert max(examined) <= 1001, plan
    assert sum(int(n) for n in re.findall(r"Removed by Filter: (\d+)", read)) <= 1000, read


def _tasks_one_second_apart(engine: Engine, names: list[str]) -> list[uuid.UUID]:
    """Tasks named ``names``, the first the newest, one second apart; their ids, newest first."""
    with engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO pgtask.tasks (queue, name, payload, created_at) "
            "SELECT 'q', name, '{}', statement_timestamp() - interval '1 hour'"
            " - make_interval(secs => i) FROM unnest(CAST(:names AS text[])) "
            "WITH ORDINALITY AS n(name, i)"
        ), {"names": names})
        return list(connection.scalars(
            select(Task.id).order_by(Task.created_at.desc(), Task.id.desc())
        ))


@pytest.mark.parametrize(
    ("change", "hits_at"),
    [
        # Retention deletes the three newest tasks: a page that counted rows would now end
        # three rows lower, past the matches just below its read.
        ("delete", [10, 11, 12]),
        # Three tasks are enqueued: a page that counted rows would end three rows higher and
        # the next page would read the matches at its bottom again.
        ("insert", [7, 8, 9]),
    ],
)
def test_pages_under_read_committed_never_skip_or_repeat_when_others_commit_in_between(
    pgtask_engine: Engine, change: str, hits_at: list[int]
) -> None:
    names = ["hit" if i in hits_at else "other" for i in range(30)]
    ids = _tasks_one_second_apart(pgtask_engine, names)
    executed: list[str] = []

    def meanwhile(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        executed.append(statement)
        if len(executed) != 2:  # just before the first page's second statement
            return
        with pgtask_engine.begin() as other:
            if change == "delete":
                other.execute(delete(Task).where(Task.id.in_(ids[:3])))
            else:
                other.execute(text(
                    "INSERT INTO pgtask.tasks (queue, name, payload)"
                    " SELECT 'q', 'other', '{}' FROM generate_series(1, 3)"
                ))

    with pgtask_engine.connect().execution_options(
        isolation_level="READ COMMITTED"
    ) as connection:
        event.listen(connection, "before_cursor_execute", meanwhile)
        pages = walk(connection, TaskFilters(name="hit"), limit=5, scan_limit=10)

    assert len(executed) >= 2
    assert [task.id for page in pages for task in page.tasks] == [ids[i] for i in hits_at]
