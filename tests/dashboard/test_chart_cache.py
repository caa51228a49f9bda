"""The charts' cache of closed buckets (`sqlalchemy_pgtask.dashboard._chart_cache`) on a real
seeded database: a cached bucket is not read again (counted in rows the statement returns),
the open bucket is read on every request, so tasks finishing now are counted, and the
cache's bound on entries holds while the charts stay right.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, func, select, update

from sqlalchemy_pgtask import enqueue
from sqlalchemy_pgtask.dashboard._chart_cache import ChartCache
from sqlalchemy_pgtask.dashboard._charts import WINDOWS, Charts, queue_charts
from sqlalchemy_pgtask.models import Task
from tests.dashboard.seed import Seeded

HOUR = WINDOWS["hour"]


class Reads:
    """Rows each chart statement returned on a connection."""

    def __init__(self, connection: Connection) -> None:
        self.rows: list[int] = []
        event.listen(connection, "after_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "'window' AS kind" in statement:
            self.rows.append(cursor.rowcount)


@pytest.fixture
def reading(pgtask_engine: Engine) -> Iterator[tuple[Connection, Reads]]:
    with pgtask_engine.connect() as connection:
        yield connection, Reads(connection)


def charts(connection: Connection, cache: ChartCache | None) -> Charts:
    return queue_charts(connection, HOUR, {}, cache)


def finish(connection: Connection, task_id: Any, minutes_ago: int) -> None:
    connection.execute(update(Task).where(Task.id == task_id).values(
        state="succeeded", completed_at=func.now() - timedelta(minutes=minutes_ago),
        created_at=func.now() - timedelta(minutes=minutes_ago + 1),
    ))


def test_a_closed_bucket_is_read_once(
    seeded: Seeded, pgtask_engine: Engine, reading: tuple[Connection, Reads]
) -> None:
    with pgtask_engine.begin() as connection:
        for minutes, task_id in zip((10, 20, 30), seeded.children, strict=False):
            finish(connection, task_id, minutes)
    connection, reads = reading
    cache = ChartCache()
    first = charts(connection, cache)
    assert first == charts(connection, None)
    assert cache.entries() > 0
    again = charts(connection, cache)
    assert again == first
    # Without a cache the window's rows; with one, only the open buckets' (and the header).
    whole, cached_read = reads.rows[0], reads.rows[2]
    assert cached_read < whole
    # A row moved into a cached bucket (what no writer does: rows are stamped with database
    # time) is not seen: the bucket was not read again.
    with pgtask_engine.begin() as writer:
        finish(writer, seeded.parent, 10)
    connection.rollback()
    assert charts(connection, cache) == first
    assert charts(connection, None) != first


def test_tasks_finishing_in_the_open_bucket_are_counted(
    seeded: Seeded, pgtask_engine: Engine, reading: tuple[Connection, Reads]
) -> None:
    connection, _ = reading
    cache = ChartCache()
    before = charts(connection, cache)
    connection.rollback()
    for _ in range(3):
        with pgtask_engine.begin() as writer:
            task_id = enqueue(writer, "send_email", {}, queue="emails").id
            writer.execute(update(Task).where(Task.id == task_id).values(
                state="succeeded", completed_at=func.now(),
            ))
        now = charts(connection, cache)
        connection.rollback()
        assert now == charts(connection, None)
    emails = {c.queue: c for c in now.queues}["emails"]
    was = {c.queue: c for c in before.queues}["emails"]
    assert sum(emails.finished) == sum(was.finished) + 3


def test_the_bound_on_entries_holds(
    seeded: Seeded, pgtask_engine: Engine, reading: tuple[Connection, Reads]
) -> None:
    with pgtask_engine.begin() as writer:
        ids = writer.scalars(select(Task.id).where(Task.queue == "emails")).all()
        for minutes, task_id in enumerate(ids[:8], start=5):
            finish(writer, task_id, minutes * 3)
    connection, _ = reading
    cache = ChartCache(max_entries=3)
    for _ in range(3):
        assert charts(connection, cache) == charts(connection, None)
        assert cache.entries() <= 3
    span = cache.span(HOUR.name)
    assert span is not None
    with pytest.raises(ValueError, match="max_entries"):
        ChartCache(max_entries=-1)


def test_the_app_keeps_one_cache(client_for: Any, seeded: Seeded) -> None:
    client = client_for()
    assert client.get("/?chart=day").status_code == 200
    assert client.get("/?chart=day").status_code == 200
    assert client.get("/").status_code == 200
