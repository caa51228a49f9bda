"""The operators' read models: what ``pgtask status``, ``task list``, ``task show`` and ``queue
list`` print, read from a real database.

Tasks are put into each state with plain SQL (the state machine itself is proven elsewhere),
except where a real worker's error document matters. Every read runs in a read-only
transaction, so a read model that wrote would fail here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, func, text, update
from sqlalchemy.engine import Connection as EngineConnection

from sqlalchemy_pgtask import (
    InvalidNameError,
    InvalidOptionError,
    Registry,
    Task,
    TaskContext,
    TaskNotFound,
    ValidationError,
    WorkerOptions,
    configure_queue,
    enqueue,
    list_queues,
)
from sqlalchemy_pgtask.states import (
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATES,
    WAITING,
    TaskState,
)
from sqlalchemy_pgtask.status import (
    QueueStatus,
    list_tasks,
    parse_task_id,
    queue_status,
    task_detail,
    task_summary,
)
from sqlalchemy_pgtask.testing import drain


@pytest.fixture
def reader(pgtask_engine: Engine) -> Iterator[Connection]:
    """A connection whose transaction is read-only: a read model that wrote would fail."""
    with pgtask_engine.connect() as connection:
        connection.execute(text("SET TRANSACTION READ ONLY"))
        yield connection


def add(engine: Engine, name: str = "job", count: int = 1, **options: Any) -> list[uuid.UUID]:
    with engine.begin() as connection:
        return [enqueue(connection, name, {"n": i}, **options).id for i in range(count)]


def set_state(engine: Engine, ids: Sequence[uuid.UUID], state: TaskState) -> None:
    """Move tasks to ``state`` directly, satisfying the table's CHECKs for that state."""
    values: dict[str, Any] = {"state": state}
    if state in TERMINAL_STATES:
        values["completed_at"] = func.statement_timestamp()
    if state == RUNNING:
        values.update(
            lease_token=uuid.uuid4(), lease_owner=uuid.uuid4(), attempt=Task.attempt + 1,
            max_attempts=5,
            lease_expires_at=func.statement_timestamp() + text("interval '1 minute'"),
        )
    with engine.begin() as connection:
        connection.execute(update(Task).where(Task.id.in_(ids)).values(values))


# -- queue_status ----------------------------------------------------------------------------


def test_queue_status_counts_every_state_per_queue(
    pgtask_engine: Engine, reader: Connection
) -> None:
    add(pgtask_engine, count=2)  # pending and due
    add(pgtask_engine, delay=3600)  # pending, not due
    set_state(pgtask_engine, add(pgtask_engine, count=3), RUNNING)
    set_state(pgtask_engine, add(pgtask_engine), WAITING)
    set_state(pgtask_engine, add(pgtask_engine, count=4), SUCCEEDED)
    set_state(pgtask_engine, add(pgtask_engine, count=2), FAILED)
    set_state(pgtask_engine, add(pgtask_engine, queue="emails"), CANCELLED)

    default, emails = queue_status(reader)

    assert default == QueueStatus(
        name="default", configured=False, paused_at=None, max_outstanding_tasks=None,
        outstanding_tasks=None, pending=3, due=2, running=3, waiting=1, succeeded=4, failed=2,
        cancelled=0,
    )
    assert (emails.name, emails.count(CANCELLED), emails.count(PENDING)) == ("emails", 1, 0)
    assert [default.count(s) for s in (PENDING, RUNNING, WAITING)] == [3, 3, 1]


def test_queue_status_lists_configured_queues_without_tasks_with_pause_and_capacity(
    pgtask_engine: Engine, reader: Connection
) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "idle", paused=True)
        configure_queue(connection, "limited", max_outstanding_tasks=10)
    add(pgtask_engine, queue="limited", count=3)

    idle, limited = queue_status(reader)

    assert (idle.name, idle.configured, idle.paused) == ("idle", True, True)
    assert idle.paused_at is not None
    assert (idle.pending, idle.succeeded, idle.max_outstanding_tasks) == (0, 0, None)
    assert (limited.paused, limited.max_outstanding_tasks, limited.outstanding_tasks) == (
        False, 10, 3,
    )
    assert limited.pending == 3


def test_queue_status_is_empty_on_a_fresh_install(reader: Connection) -> None:
    assert queue_status(reader) == []


def test_finished_tasks_are_counted_from_a_partial_index_on_terminal_tasks(
    pgtask_engine: Engine,
) -> None:
    """The terminal counts say ``state IN (...)`` with literal states, so a partial index on
    terminal tasks serves them; no statement of queue_status reads the whole table."""
    set_state(pgtask_engine, add(pgtask_engine, count=3), SUCCEEDED)
    with pgtask_engine.begin() as connection:
        connection.execute(text("ANALYZE pgtask.tasks"))
        terminal_indexes = set(connection.execute(text(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'pgtask'"
            " AND tablename = 'tasks' AND indexdef LIKE '%succeeded%'"
        )).scalars())
    assert terminal_indexes == {"ix_tasks_finished"}

    statements: list[tuple[str, Any]] = []

    def record(_c: EngineConnection, _cur: Any, sql: str, params: Any, *_: Any) -> None:
        statements.append((sql, params))

    with pgtask_engine.connect() as connection:
        event.listen(connection, "before_cursor_execute", record)
        [default] = queue_status(connection)
        event.remove(connection, "before_cursor_execute", record)
        assert default.succeeded == 3
        task_statements = [s for s in statements if "pgtask.tasks" in s[0]]
        # Pending (with the due part), running and waiting, finished.
        assert len(task_statements) == 3
        connection.execute(text("SET enable_seqscan = off"))
        for sql, params in task_statements:
            plan = "\n".join(connection.exec_driver_sql(f"EXPLAIN {sql}", params).scalars())
            assert "Seq Scan" not in plan, plan
            assert "pk_tasks" not in plan, plan  # not a walk over every task by id
            if "'succeeded'" in sql:
                assert any(index in plan for index in terminal_indexes), plan
            else:
                # Pending from (queue, run_at) of the pending tasks, index only.
                assert "ix_tasks_outstanding" in plan or "ix_tasks_pending_run_at" in plan, plan


# -- list_tasks ------------------------------------------------------------------------------


def test_list_tasks_is_newest_first_and_filters_combine(
    pgtask_engine: Engine, reader: Connection
) -> None:
    old = add(pgtask_engine, "a")
    middle = add(pgtask_engine, "b", queue="emails")
    new = add(pgtask_engine, "a", count=2)
    set_state(pgtask_engine, new[:1], SUCCEEDED)

    everything = list_tasks(reader)
    assert [t.id for t in everything][-2:] == [middle[0], old[0]]
    assert {t.id for t in everything[:2]} == set(new)  # one transaction: same created_at
    assert [t.id for t in list_tasks(reader, queue="emails")] == middle
    assert [t.id for t in list_tasks(reader, name="a", state=PENDING)] == [new[1], old[0]]
    assert [t.id for t in list_tasks(reader, state=SUCCEEDED)] == new[:1]
    assert list_tasks(reader, name="a", queue="emails") == []
    [summary] = list_tasks(reader, queue="emails")
    assert (summary.name, summary.version, summary.state, summary.attempt) == ("b", 1, PENDING, 0)


def test_list_tasks_pages_with_a_keyset_cursor(pgtask_engine: Engine, reader: Connection) -> None:
    for _ in range(5):
        add(pgtask_engine)  # one transaction each: distinct created_at

    first = list_tasks(reader, limit=2)
    second = list_tasks(reader, limit=2, before=first[-1].id)
    third = list_tasks(reader, limit=2, before=second[-1].id)

    pages = [t.id for t in first + second + third]
    assert pages == [t.id for t in list_tasks(reader)]
    assert len(pages) == 5
    with pytest.raises(TaskNotFound):
        list_tasks(reader, before=uuid.uuid4())


@pytest.mark.parametrize(
    ("filters", "error"),
    [
        ({"state": "done"}, InvalidOptionError),
        ({"queue": "no spaces"}, InvalidNameError),
        ({"name": ""}, InvalidNameError),
        ({"limit": 0}, InvalidOptionError),
        ({"limit": 10_001}, InvalidOptionError),
        ({"before": "not-a-uuid"}, InvalidOptionError),
    ],
)
def test_list_tasks_rejects_bad_filters_before_any_sql(
    reader: Connection, filters: dict[str, Any], error: type[ValidationError]
) -> None:
    with pytest.raises(error):
        list_tasks(reader, **filters)
    assert reader.execute(text("SELECT 1")).scalar_one() == 1  # the transaction is intact


# -- task_detail and task_summary ------------------------------------------------------------


async def test_task_detail_has_the_error_and_every_attempt_of_a_failed_task(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    registry = Registry()

    @registry.task("boom", max_attempts=2)
    async def boom(ctx: TaskContext, payload: Any) -> None:
        raise RuntimeError(f"attempt {ctx.attempt} failed")

    [task_id] = add(pgtask_engine, "boom", headers={"trace": "t-1"}, max_attempts=2)
    options = WorkerOptions(lease_duration=1.5, shutdown_grace=1.0)
    await drain(registry, pgtask_database_url, options)
    # The retry is scheduled with a backoff: make it due and drain again.
    with pgtask_engine.begin() as connection:
        connection.execute(
            update(Task).where(Task.id == task_id).values(run_at=func.statement_timestamp())
        )
    await drain(registry, pgtask_database_url, options)

    with pgtask_engine.connect() as connection:
        detail = task_detail(connection, str(task_id))
    assert detail is not None
    assert (detail.id, detail.name, detail.state, detail.attempt) == (task_id, "boom", FAILED, 2)
    assert (detail.payload, detail.headers, detail.result) == ({"n": 0}, {"trace": "t-1"}, None)
    assert detail.completed_at is not None
    assert detail.error is not None
    assert detail.error["message"] == "attempt 2 failed"
    assert "Traceback (most recent call last)" in detail.error["traceback"]
    assert [(a.attempt, a.state) for a in detail.attempts] == [(1, "failed"), (2, "failed")]
    first = detail.attempts[0]
    assert first.worker_id is not None
    assert first.finished_at is not None
    assert first.finished_at >= first.started_at
    assert first.error is not None
    assert first.error["message"] == "attempt 1 failed"


def test_task_detail_and_summary_of_an_unknown_task_are_none(reader: Connection) -> None:
    assert task_detail(reader, uuid.uuid4()) is None
    assert task_summary(reader, uuid.uuid4()) is None


def test_task_summary_reads_one_task(pgtask_engine: Engine, reader: Connection) -> None:
    [task_id] = add(pgtask_engine, priority=7)
    summary = task_summary(reader, task_id)
    assert summary is not None
    assert (summary.id, summary.priority, summary.state) == (task_id, 7, PENDING)


def test_parse_task_id_accepts_uuids_and_their_text() -> None:
    value = uuid.uuid4()
    assert parse_task_id(value) is value
    assert parse_task_id(str(value).upper()) == value
    with pytest.raises(InvalidOptionError, match="'nope' is not a UUID"):
        parse_task_id("nope")


# -- queue settings (read through queues.list_queues) ----------------------------------------


def test_queue_settings_reads_the_rows_by_name(pgtask_engine: Engine, reader: Connection) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "b", terminal_retention_seconds=60)
        configure_queue(connection, "a", max_outstanding_tasks=5, paused=True)

    a, b = list_queues(reader)
    assert (a.name, a.max_outstanding_tasks, a.paused_at is not None) == ("a", 5, True)
    assert (b.name, b.terminal_retention_seconds, b.max_outstanding_tasks) == ("b", 60, None)
