"""One trigger run per statement for tasks entering or leaving a final state.

``tasks_terminal_changed`` reads the statement's transition tables: whatever number of tasks
one ``UPDATE`` finishes, result waiters get every id (one notification per 200, each payload
under PostgreSQL's 8,000-byte limit), capacity is given back for each of them, and tasks moved
back from a final state need room like new ones. An ``UPDATE`` that finishes nothing notifies
nobody.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import EnqueueRequest, QueueFull, configure_queue, enqueue, enqueue_many
from tests.support.urls import libpq_url

FINISH_ALL = text(
    "UPDATE pgtask.tasks SET state = :state, completed_at = statement_timestamp() "
    "WHERE queue = :queue AND state = 'pending'"
)


def _add(engine: Engine, count: int, queue: str = "default") -> list[uuid.UUID]:
    with Session(engine) as session:
        results = enqueue_many(
            session, [EnqueueRequest(name="t", queue=queue) for _ in range(count)]
        )
        session.commit()
    return [result.id for result in results]


def _result_payloads(url: str, engine: Engine, statement: str) -> list[str]:
    """The ``pgtask_result`` payloads that committing ``statement`` sends."""
    with psycopg.connect(libpq_url(url), autocommit=True) as listener:
        listener.execute("LISTEN pgtask_result")
        with engine.begin() as connection:
            connection.execute(text(statement))
        # A sentinel sent afterwards: everything before it has arrived once it does.
        with psycopg.connect(libpq_url(url), autocommit=True) as other:
            other.execute("SELECT pg_notify('pgtask_result', 'sentinel')")
        payloads = []
        for notification in listener.notifies(timeout=30):
            if notification.payload == "sentinel":
                break
            payloads.append(notification.payload)
    return payloads


def test_one_statement_finishing_450_tasks_notifies_every_id_once_in_chunks(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    ids = _add(pgtask_engine, 450)
    payloads = _result_payloads(
        pgtask_database_url, pgtask_engine,
        "UPDATE pgtask.tasks SET state = 'cancelled', completed_at = statement_timestamp()",
    )
    assert len(payloads) == 3  # 200 + 200 + 50
    assert all(len(p.encode()) < 8000 for p in payloads)
    notified = [uuid.UUID(part) for p in payloads for part in p.split(",")]
    assert sorted(notified) == sorted(ids)


def test_a_statement_that_finishes_nothing_notifies_nobody(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    _add(pgtask_engine, 3)
    assert _result_payloads(
        pgtask_database_url, pgtask_engine, "UPDATE pgtask.tasks SET priority = 5"
    ) == []


def test_finishing_many_tasks_at_once_gives_back_their_capacity(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "limited", max_outstanding_tasks=5)
        session.commit()
    _add(pgtask_engine, 5, queue="limited")
    with pgtask_engine.begin() as connection:
        connection.execute(FINISH_ALL, {"state": "succeeded", "queue": "limited"})
    _add(pgtask_engine, 5, queue="limited")  # all five places are free again
    with Session(pgtask_engine) as session, pytest.raises(QueueFull):
        enqueue(session, "t", queue="limited")


def test_moving_many_finished_tasks_back_at_once_needs_room_for_each(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session:
        configure_queue(session, "limited", max_outstanding_tasks=3)
        session.commit()
    _add(pgtask_engine, 3, queue="limited")
    with pgtask_engine.begin() as connection:
        connection.execute(FINISH_ALL, {"state": "failed", "queue": "limited"})
    _add(pgtask_engine, 2, queue="limited")
    back = text(
        "UPDATE pgtask.tasks SET state = 'pending', completed_at = NULL "
        "WHERE queue = 'limited' AND state = 'failed'"
    )
    with pgtask_engine.connect() as connection:
        # Three back with one place left: the statement fails whole, PT001.
        with pytest.raises(Exception, match="capacity of 3") as raised:
            connection.execute(back)
        assert getattr(raised.value.orig, "sqlstate", None) == "PT001"  # type: ignore[attr-defined]
        connection.rollback()
    with pgtask_engine.begin() as connection:
        connection.execute(text(
            "UPDATE pgtask.tasks SET state = 'pending', completed_at = NULL WHERE id = "
            "(SELECT id FROM pgtask.tasks WHERE queue = 'limited' AND state = 'failed' LIMIT 1)"
        ))
    with Session(pgtask_engine) as session, pytest.raises(QueueFull):
        enqueue(session, "t", queue="limited")
