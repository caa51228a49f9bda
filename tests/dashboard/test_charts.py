"""The overview's per-queue charts (`sqlalchemy_pgtask.dashboard._charts`) on a real seeded
database: each chart counts what the tasks table holds for its window, bucket by bucket, the
depth follows its definition (tasks created before a bucket's end and not finished by it),
the day window is a link away, and a chart is one statement.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Connection, Engine, event, func, select, update
from starlette.testclient import TestClient

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.dashboard._charts import WINDOWS, queue_charts
from sqlalchemy_pgtask.models import Task
from tests.dashboard.seed import Seeded

Apps = Callable[..., TestClient]
SVG = re.compile(r'<svg class="chart chart-(\w+)"[^>]*data-total="(\d+)"[^>]*>(.*?)</svg>', re.S)
BAR = re.compile(r"<title>(\d\d:\d\d) UTC: (\d+) (\w+)</title>")


def charts_of(html: str, queue: str) -> dict[str, tuple[int, str]]:
    """``kind: (data-total, inner markup)`` of the charts on ``queue``'s row."""
    row = re.search(rf'<tr data-chart-queue="{queue}">(.*?)</tr>', html, re.S)
    assert row is not None, f"no chart row for {queue}"
    return {kind: (int(total), body) for kind, total, body in SVG.findall(row.group(1))}


def finished_in(connection: Connection, queue: str, since: timedelta, state: str | None) -> int:
    query = select(func.count()).select_from(Task).where(
        Task.queue == queue, Task.completed_at >= func.now() - since
    )
    if state is not None:
        query = query.where(Task.state == state)
    return int(connection.scalar(query) or 0)


def test_the_charts_count_the_seeded_tasks(
    client_for: Apps, seeded: Seeded, pgtask_engine: Engine
) -> None:
    # Two more failures, 10 minutes ago: a bar of their own.
    with pgtask_engine.begin() as connection:
        connection.execute(update(Task).where(Task.id == seeded.failed).values(
            completed_at=func.now() - timedelta(minutes=10),
        ))
        ten_ago = connection.scalar(select(Task.completed_at).where(Task.id == seeded.failed))
    assert isinstance(ten_ago, datetime)

    page = client_for().get("/")

    assert page.status_code == 200
    assert 'data-testid="charts" data-window="hour"' in page.text
    emails = charts_of(page.text, "emails")
    with pgtask_engine.connect() as connection:
        finished = finished_in(connection, "emails", timedelta(hours=1), None)
        queues = {q.name: q for q in status.queue_status(connection)}
    assert finished == 5  # four succeeded, one failed
    assert emails["finished"][0] == finished
    assert emails["failed"][0] == 1
    bars = BAR.findall(emails["failed"][1])
    minute = ten_ago.astimezone(timezone.utc).strftime("%H:%M")
    assert bars == [(minute, "1", "failed")]
    outstanding = queues["emails"].pending + queues["emails"].running + queues["emails"].waiting
    assert emails["depth"][0] == outstanding
    # A queue with only outstanding work is charted too, by its depth.
    reports = charts_of(page.text, "reports")
    assert reports["finished"][0] == 0
    assert reports["depth"][0] == 1


def test_depth_follows_its_definition_bucket_by_bucket(
    seeded: Seeded, pgtask_engine: Engine
) -> None:
    window = WINDOWS["hour"]
    with pgtask_engine.begin() as connection:
        # Finished tasks spread over the hour, so depth changes along it.
        for minutes, task_id in zip((5, 17, 33, 48), (seeded.succeeded, *seeded.children,
                                                       seeded.failed), strict=True):
            connection.execute(update(Task).where(Task.id == task_id).values(
                state="succeeded", completed_at=func.now() - timedelta(minutes=minutes),
                created_at=func.now() - timedelta(minutes=minutes + 2),
            ))
    with pgtask_engine.connect() as connection:
        queues = status.queue_status(connection)
        outstanding = {q.name: q.pending + q.running + q.waiting for q in queues}
        charts = queue_charts(connection, window, outstanding)
        assert charts.start is not None
        for chart in charts.queues:
            expected = []
            for bucket in range(window.buckets):
                end = charts.start + timedelta(seconds=(bucket + 1) * window.bucket_seconds)
                expected.append(int(connection.scalar(
                    select(func.count()).select_from(Task).where(
                        Task.queue == chart.queue, Task.created_at < end,
                        (Task.completed_at.is_(None)) | (Task.completed_at >= end),
                    )
                ) or 0))
            # The last bucket ends in the future: its depth is now's.
            expected[-1] = outstanding.get(chart.queue, 0)
            assert list(chart.depth) == expected, chart.queue
    assert {c.queue for c in charts.queues} == {"emails", "reports", "default"}


def test_the_day_window_is_a_link_away_and_another_is_refused(
    client_for: Apps, seeded: Seeded
) -> None:
    client = client_for()
    overview = client.get("/").text
    assert 'href="/?chart=day"' in overview
    day = client.get("/?chart=day")
    assert day.status_code == 200
    assert 'data-window="day"' in day.text
    assert charts_of(day.text, "emails")["finished"][0] == 5
    assert client.get("/?chart=week").status_code == 400


def test_no_queue_no_chart(client_for: Apps) -> None:
    page = client_for().get("/")
    assert page.status_code == 200
    assert 'data-testid="no-charts"' in page.text


@pytest.mark.parametrize("window", list(WINDOWS))
def test_a_chart_is_one_statement(seeded: Seeded, pgtask_engine: Engine, window: str) -> None:
    statements: list[str] = []
    with pgtask_engine.connect() as connection:
        event.listen(connection, "before_cursor_execute",
                     lambda *args: statements.append(args[2]))
        charts = queue_charts(connection, WINDOWS[window], {})
    assert len(statements) == 1
    assert charts.queues
    assert all(isinstance(c.queue, str) for c in charts.queues)
    assert uuid.UUID(str(seeded.failed))
