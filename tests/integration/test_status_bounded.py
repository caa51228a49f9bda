"""The bounded forms of the overview read models the dashboard uses: `queue_status` with
``finished_since`` counts only the span's finished tasks, and `unroutable` with ``per_queue``
looks only at the next tasks of each queue in claim order; both read index ranges, and bad
bounds are refused before any SQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, text, update

from sqlalchemy_pgtask import InvalidOptionError, Task, enqueue
from sqlalchemy_pgtask.status import queue_status, unroutable
from sqlalchemy_pgtask.status._overview import finished_by_queue


@pytest.fixture
def reader(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.connect() as connection:
        connection.execute(text("SET TRANSACTION READ ONLY"))
        yield connection


def add(engine: Engine, name: str, count: int, **options: Any) -> list[uuid.UUID]:
    with engine.begin() as connection:
        return [enqueue(connection, name, {"n": i}, **options).id for i in range(count)]


def finish(engine: Engine, ids: Sequence[uuid.UUID], state: str, ago: timedelta) -> None:
    with engine.begin() as connection:
        connection.execute(update(Task).where(Task.id.in_(ids)).values(
            state=state, completed_at=func.statement_timestamp() - ago,
            created_at=func.statement_timestamp() - ago - timedelta(seconds=1),
        ))


def test_finished_since_counts_only_the_span(pgtask_engine: Engine, reader: Connection) -> None:
    finish(pgtask_engine, add(pgtask_engine, "job", 3), "succeeded", timedelta(minutes=5))
    finish(pgtask_engine, add(pgtask_engine, "job", 2), "failed", timedelta(hours=3))
    finish(pgtask_engine, add(pgtask_engine, "job", 4, queue="other"), "cancelled",
           timedelta(days=3))
    add(pgtask_engine, "job", 1, queue="other")  # pending

    every = {q.name: q for q in queue_status(reader)}
    day = {q.name: q for q in queue_status(reader, finished_since=timedelta(days=1))}
    hour = {q.name: q for q in queue_status(reader, finished_since=timedelta(hours=1))}

    assert (every["default"].succeeded, every["default"].failed) == (3, 2)
    assert every["other"].cancelled == 4
    assert (day["default"].succeeded, day["default"].failed) == (3, 2)
    assert day["other"].cancelled == 0
    assert day["other"].pending == every["other"].pending == 1
    assert (hour["default"].succeeded, hour["default"].failed) == (3, 0)
    assert finished_by_queue(reader, timedelta(hours=1)) == {("default", "succeeded"): 3}


def test_unroutable_per_queue_looks_at_the_next_tasks_in_claim_order(
    pgtask_engine: Engine, reader: Connection
) -> None:
    add(pgtask_engine, "first", 3, priority=5)
    add(pgtask_engine, "later", 4)
    add(pgtask_engine, "elsewhere", 2, queue="other")

    assert [(u.queue, u.name, u.count) for u in unroutable(reader)] == [
        ("default", "first", 3), ("default", "later", 4), ("other", "elsewhere", 2),
    ]
    assert [(u.queue, u.name, u.count) for u in unroutable(reader, per_queue=5)] == [
        ("default", "first", 3), ("default", "later", 2), ("other", "elsewhere", 2),
    ]
    assert [(u.queue, u.name, u.count) for u in unroutable(reader, per_queue=1)] == [
        ("default", "first", 1), ("other", "elsewhere", 1),
    ]


@pytest.mark.parametrize("bad", [0, -3])
def test_a_bad_per_queue_is_refused(reader: Connection, bad: int) -> None:
    with pytest.raises(InvalidOptionError, match="per_queue"):
        unroutable(reader, per_queue=bad)
