"""The audit log: queue pause, resume and configuration entries, the append-only guarantee,
and reading the log a page at a time."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, delete, func, insert, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    QueueSettings,
    ValidationError,
    cancel,
    configure_queue,
    configure_queue_async,
    enqueue,
)
from sqlalchemy_pgtask.admin import (
    pause_queue,
    pause_queue_async,
    resume_queue,
    resume_queue_async,
    retry,
)
from sqlalchemy_pgtask.audit import AuditRecord, audit_statement, list_audit, list_audit_async
from sqlalchemy_pgtask.models import AuditEntry
from tests.support.waiting import PATIENCE, wait_until


def audit(engine: Engine, **filters: Any) -> list[AuditRecord]:
    with engine.connect() as connection:
        return list_audit(connection, **filters)


def summary(entries: list[AuditRecord]) -> list[tuple[Any, ...]]:
    return [(e.action, e.queue, e.actor, e.reason, e.details) for e in entries]


# -- queue actions -----------------------------------------------------------------------------


def test_pause_and_resume_are_audited_when_they_change_the_queue(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        paused = pause_queue(connection, "emails", actor="alice", reason="smtp outage")
        again = pause_queue(connection, "emails", actor="alice")  # already paused
    assert isinstance(paused, QueueSettings)
    assert paused.paused
    assert again.paused_at == paused.paused_at
    with pgtask_engine.begin() as connection:
        resumed = resume_queue(connection, "emails", actor="bob")
        resume_queue(connection, "emails", actor="bob")  # not paused: nothing
    assert not resumed.paused
    assert paused.paused_at is not None

    assert summary(audit(pgtask_engine)) == [
        ("queue.resume", "emails", "bob", None, {"paused_since": paused.paused_at.isoformat()}),
        ("queue.pause", "emails", "alice", "smtp outage", None),
    ]


@pytest.mark.parametrize(
    "change",
    [
        lambda c, actor: pause_queue(c, "fresh", actor=actor),
        lambda c, actor: configure_queue(c, "fresh", rate_limit=5, actor=actor),
    ],
    ids=["pause", "configure"],
)
def test_two_callers_creating_one_queue_write_one_entry(
    pgtask_engine: Engine, change: Any
) -> None:
    # With no row to lock, both read "no queue" and each wrote an entry, the second a
    # "created" one although the first had created the queue and it changed nothing.
    with pgtask_engine.connect() as first:
        first.begin()
        change(first, "alice")
        second = threading.Thread(target=lambda: _in_transaction(pgtask_engine, change, "bob"))
        second.start()
        wait_until(lambda: _waiting_for_a_lock(pgtask_engine), PATIENCE,
                   message="the second caller to wait for the first")
        first.commit()
    second.join(PATIENCE)
    assert not second.is_alive()
    assert [e.actor for e in audit(pgtask_engine)] == ["alice"]


def _in_transaction(engine: Engine, change: Any, actor: str) -> None:
    with engine.begin() as connection:
        change(connection, actor)


def _waiting_for_a_lock(engine: Engine) -> bool:
    with engine.connect() as connection:
        return bool(connection.scalar(text(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )))


def test_configure_queue_records_the_settings_that_changed(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "reports")  # a row with the defaults: nothing to record
        configure_queue(connection, "emails", max_outstanding_tasks=10, actor="alice")
        configure_queue(
            connection, "emails", max_outstanding_tasks=10, terminal_retention_seconds=60,
            rate_limit=5, reason="tuning",
        )
        configure_queue(connection, "emails", max_outstanding_tasks=10)  # no change
        configure_queue(connection, "emails", paused=True, starvation_timeout=30)
        role = connection.scalar(text("SELECT current_user"))

    assert summary(audit(pgtask_engine)) == [
        ("queue.configure", "emails", role, None,
         {"changes": {"starvation_timeout_seconds": {"from": None, "to": 30.0}}}),
        ("queue.pause", "emails", role, None, None),
        ("queue.configure", "emails", role, "tuning", {"changes": {
            "terminal_retention_seconds": {"from": 604800, "to": 60},
            "rate_limit": {"from": None, "to": 5},
            "rate_period_seconds": {"from": None, "to": 1.0},
        }}),
        ("queue.configure", "emails", "alice", None,
         {"created": True, "settings": {"max_outstanding_tasks": 10}}),
    ]


async def test_the_async_queue_actions_audit_in_the_callers_transaction(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    async with pgtask_async_engine.connect() as connection:
        await pause_queue_async(connection, "q", actor="a")
        await connection.rollback()
    assert audit(pgtask_engine) == []
    async with pgtask_async_engine.begin() as connection:
        assert (await pause_queue_async(connection, "q", actor="a")).paused
        assert not (await resume_queue_async(connection, "q", actor="b", reason="r")).paused
        await configure_queue_async(connection, "q", rate_limit=3, rate_period=60, actor="c")
    assert [(e.action, e.actor) for e in audit(pgtask_engine)] == [
        ("queue.configure", "c"), ("queue.resume", "b"), ("queue.pause", "a"),
    ]


@pytest.mark.parametrize(
    "kwargs",
    [{"actor": ""}, {"actor": "x" * 256}, {"reason": "r" * 1001}, {"reason": 3}],
)
def test_queue_actions_refuse_a_bad_actor_or_reason_before_any_sql(
    pgtask_engine: Engine, kwargs: dict[str, Any]
) -> None:
    with Session(pgtask_engine) as session:
        for call in (pause_queue, resume_queue, configure_queue):
            with pytest.raises(ValidationError):
                call(session, "q", **kwargs)
        with pytest.raises(ValidationError):
            pause_queue(session, "no spaces")
        assert not session.in_transaction()


# -- append-only -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        update(AuditEntry).values(actor="mallory"),
        delete(AuditEntry),
        text("TRUNCATE pgtask.audit_log"),
    ],
    ids=["update", "delete", "truncate"],
)
def test_the_audit_log_refuses_updates_deletes_and_truncation(
    pgtask_engine: Engine, statement: Any
) -> None:
    with pgtask_engine.begin() as connection:
        pause_queue(connection, "q", actor="alice")
    with pgtask_engine.connect() as connection, pytest.raises(DBAPIError) as refused:
        connection.execute(statement)
    assert isinstance(refused.value.orig, psycopg.Error)
    assert refused.value.orig.sqlstate == "PT003"
    assert "append-only" in str(refused.value.orig)
    assert [(e.action, e.actor) for e in audit(pgtask_engine)] == [("queue.pause", "alice")]


# -- reading -----------------------------------------------------------------------------------


def _entries(engine: Engine) -> dict[str, uuid.UUID]:
    """Tasks a, b (queue emails) with a cancel and a retry each, then a schedule entry."""
    with engine.begin() as connection:
        a = enqueue(connection, "job").id
        b = enqueue(connection, "job", queue="emails").id
        for task_id in (a, b):
            cancel(connection, task_id, actor="ops")
            retry(connection, task_id, actor="ops")
        connection.execute(audit_statement("schedule.pause", actor="ops", schedule="nightly"))
    return {"a": a, "b": b}


def test_list_audit_reads_newest_first_and_filters(pgtask_engine: Engine) -> None:
    ids = _entries(pgtask_engine)
    everything = audit(pgtask_engine)
    assert [e.action for e in everything] == [
        "schedule.pause", "task.retry", "task.cancel", "task.retry", "task.cancel",
    ]
    assert [e.id for e in everything] == sorted((e.id for e in everything), reverse=True)
    assert all(e.occurred_at is not None for e in everything)

    by_task = audit(pgtask_engine, task_id=str(ids["a"]))
    assert [(e.action, e.task_id) for e in by_task] == [
        ("task.retry", ids["a"]), ("task.cancel", ids["a"]),
    ]
    assert {e.task_id for e in audit(pgtask_engine, queue="emails")} == {ids["b"]}
    assert [e.action for e in audit(pgtask_engine, schedule="nightly")] == ["schedule.pause"]
    assert audit(pgtask_engine, task_id=ids["a"], queue="emails") == []


def test_list_audit_pages_by_id(pgtask_engine: Engine) -> None:
    _entries(pgtask_engine)
    everything = audit(pgtask_engine)
    first = audit(pgtask_engine, limit=2)
    second = audit(pgtask_engine, limit=2, before_id=first[-1].id)
    third = audit(pgtask_engine, limit=2, before_id=second[-1].id)
    assert first + second + third == everything
    assert len(third) == 1
    # A new entry does not shift the pages already read.
    with pgtask_engine.begin() as connection:
        pause_queue(connection, "q")
    assert audit(pgtask_engine, limit=2, before_id=first[-1].id) == second


async def test_list_audit_async_reads_in_the_callers_transaction(
    pgtask_async_engine: AsyncEngine,
) -> None:
    async with pgtask_async_engine.connect() as connection:
        await pause_queue_async(connection, "q", actor="a")
        [entry] = await list_audit_async(connection, queue="q")  # not committed: its own
        await connection.rollback()
        assert await list_audit_async(connection) == []
    assert (entry.action, entry.actor, entry.queue) == ("queue.pause", "a", "q")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 10_001}, "limit"),
        ({"limit": True}, "limit"),
        ({"before_id": 0}, "before_id"),
        ({"task_id": "nope"}, "task_id"),
        ({"queue": "a b"}, "queue"),
        ({"schedule": ""}, "schedule"),
    ],
)
def test_list_audit_refuses_bad_filters_before_any_sql(
    pgtask_engine: Engine, kwargs: dict[str, Any], field: str
) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(ValidationError) as refused:
            list_audit(session, **kwargs)
        assert refused.value.field == field
        assert not session.in_transaction()


def test_an_entry_outlives_the_task_it_names(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
        cancel(connection, task_id, actor="ops")
        connection.execute(text("DELETE FROM pgtask.tasks WHERE id = :id"), {"id": task_id})
    [entry] = audit(pgtask_engine, task_id=task_id)
    assert entry.action == "task.cancel"


def test_the_database_refuses_an_entry_without_an_actor_or_with_an_unknown_action(
    pgtask_engine: Engine,
) -> None:
    # The CHECK constraints hold for writers that bypass the library.
    for values in ({"actor": "", "action": "task.retry"}, {"actor": "a", "action": "drop"}):
        with pgtask_engine.connect() as connection, pytest.raises(DBAPIError) as refused:
            connection.execute(insert(AuditEntry).values(**values))
        assert refused.value.orig is not None
        assert getattr(refused.value.orig, "sqlstate", None) == "23514"
    with pgtask_engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(AuditEntry)) == 0
