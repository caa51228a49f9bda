"""Queue settings: capacity limits counted exactly, pause, retention values."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    InvalidOptionError,
    Queue,
    QueueFull,
    Task,
    configure_queue,
    enqueue,
    enqueue_many,
)


def test_configure_queue_creates_a_row_with_defaults(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        row = configure_queue(session, "reports")
        session.commit()
    assert row["name"] == "reports"
    assert row["max_outstanding_tasks"] is None
    assert row["terminal_retention_seconds"] == 7 * 24 * 3600
    assert row["idempotency_retention_seconds"] == 30 * 24 * 3600
    assert row["paused_at"] is None


def test_turning_a_limit_on_counts_the_tasks_already_outstanding(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        enqueue_many(session, [EnqueueRequest(name="t", queue="q") for _ in range(3)])
        done = enqueue(session, "t", queue="q").id
        session.execute(
            update(Task).where(Task.id == done)
            .values(state="succeeded", completed_at=func.statement_timestamp())
        )
        session.commit()
        row = configure_queue(session, "q", max_outstanding_tasks=4)
        session.commit()
        assert row["outstanding_tasks"] == 3  # the finished task does not count
        enqueue(session, "t", queue="q")
        session.commit()
        with pytest.raises(QueueFull):
            enqueue(session, "t", queue="q")
        session.rollback()


def test_removing_the_limit_stops_counting(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "q", max_outstanding_tasks=1)
        enqueue(session, "t", queue="q")
        session.commit()
        row = configure_queue(session, "q", max_outstanding_tasks=None)
        session.commit()
        assert (row["max_outstanding_tasks"], row["outstanding_tasks"]) == (None, 0)
        enqueue_many(session, [EnqueueRequest(name="t", queue="q") for _ in range(5)])
        session.commit()
        assert session.get_one(Queue, "q").outstanding_tasks == 0


def test_only_the_options_passed_change(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "q", max_outstanding_tasks=7, terminal_retention_seconds=60)
        first_pause = configure_queue(session, "q", paused=True)["paused_at"]
        again = configure_queue(session, "q", paused=True)
        session.commit()
        assert again["paused_at"] == first_pause  # pausing twice keeps the first time
        assert (again["max_outstanding_tasks"], again["terminal_retention_seconds"]) == (7, 60)
        resumed = configure_queue(session, "q", paused=False)
        session.commit()
    assert resumed["paused_at"] is None
    assert resumed["max_outstanding_tasks"] == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_outstanding_tasks": 0},
        {"terminal_retention_seconds": -1},
        {"idempotency_retention_seconds": 1.5},
        {"paused": "yes"},
    ],
)
def test_bad_settings_are_rejected_before_any_write(
    pgtask_engine: Engine, kwargs: dict[str, object]
) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(InvalidOptionError):
            configure_queue(session, "q", **kwargs)  # type: ignore[arg-type]
        assert not session.in_transaction()
        assert session.scalar(select(func.count()).select_from(Queue)) == 0
