"""Administrative retry and audited cancellation, against a real worker and database.

``retry`` turns a failed or cancelled task back into a pending one with a fresh budget of
failed attempts, keeping its history; it locks the task row so concurrent retries change the
task once, and a refused retry writes nothing. ``cancel`` is audited when it changes a task.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Fail,
    Registry,
    RetryPolicy,
    Task,
    TaskContext,
    TaskNotFound,
    WorkerOptions,
    cancel,
    cancel_async,
    configure_queue,
    enqueue,
)
from sqlalchemy_pgtask.admin import retry, retry_async
from sqlalchemy_pgtask.audit import AuditRecord, list_audit
from sqlalchemy_pgtask.errors import TaskNotRetryable, ValidationError
from sqlalchemy_pgtask.models import AuditEntry
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker
from sqlalchemy_pgtask.testing import wait_until as wait_until_async
from tests.support.tasks import add, attempt_rows, task_row
from tests.support.waiting import PATIENCE, wait_event, wait_until

OPTIONS = WorkerOptions(lease_duration=1.5, shutdown_grace=2.0)
NOW_AGAIN = RetryPolicy.fixed(0.0, jitter=False)


def audit(engine: Engine, **filters: Any) -> list[AuditRecord]:
    with engine.connect() as connection:
        return list_audit(connection, **filters)


def count_audit(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(select(func.count()).select_from(AuditEntry)) or 0)


def full_row(engine: Engine, task_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as connection:
        return dict(
            connection.execute(select(Task.__table__).where(Task.id == task_id)).mappings().one()
        )


def flaky_registry(outcomes: list[str]) -> Registry:
    """A handler ``job`` that fails while ``outcomes`` starts with ``"fail"``: each run pops
    one outcome (an empty list succeeds)."""
    registry = Registry()

    @registry.task("job", retry=NOW_AGAIN, max_attempts=2)
    async def job(ctx: TaskContext, payload: Any) -> dict[str, int]:
        if outcomes and outcomes.pop(0) == "fail":
            raise RuntimeError("asked to fail")
        return {"attempt": ctx.attempt}

    return registry


async def finished(engine: AsyncEngine, task_id: uuid.UUID, state: str, attempt: int) -> None:
    """Wait until the task is ``state`` after attempt number ``attempt``."""

    async def reached() -> bool:
        row = await task_row(engine, task_id)
        return bool(row["state"] == state and row["attempt"] == attempt)

    await wait_until_async(reached, PATIENCE, message=f"{task_id} {state} at attempt {attempt}")


def set_state(engine: Engine, task_id: uuid.UUID, state: str) -> None:
    """Put a task in ``state`` directly, with the columns that state needs."""
    values: dict[str, Any] = {"state": state}
    if state in ("succeeded", "failed", "cancelled"):
        values["completed_at"] = func.statement_timestamp()
    if state == "running":
        values.update(
            attempt=1, max_attempts=3, lease_token=uuid.uuid4(), lease_owner=uuid.uuid4(),
            lease_expires_at=func.statement_timestamp(),
        )
    with engine.begin() as connection:
        connection.execute(update(Task).where(Task.id == task_id).values(**values))


# -- retry runs the task again ---------------------------------------------------------------


async def test_a_failed_task_retried_gets_a_fresh_budget_and_keeps_its_history(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    outcomes = ["fail"] * 4
    async with running_worker(flaky_registry(outcomes), pgtask_database_url, OPTIONS):
        task_id = await add(pgtask_async_engine, "job")
        await finished(pgtask_async_engine, task_id, "failed", 2)
        first = await task_row(pgtask_async_engine, task_id)
        assert (first["attempt"], first["failed_attempts"], first["max_attempts"]) == (2, 2, 2)

        # Exhausted: a retry gives it max_attempts (2) failures again, not one more, not more.
        with pgtask_engine.begin() as connection:
            assert retry(connection, task_id, actor="alice", reason="fixed the bug") == "failed"
        await finished(pgtask_async_engine, task_id, "failed", 4)
        again = await task_row(pgtask_async_engine, task_id)
        assert (again["attempt"], again["failed_attempts"]) == (4, 2)
        assert outcomes == []

        # Now the handler succeeds: the next attempt number continues the history.
        with pgtask_engine.begin() as connection:
            retry(connection, task_id, actor="alice")
        await finished(pgtask_async_engine, task_id, "succeeded", 5)

    done = await task_row(pgtask_async_engine, task_id)
    assert (done["attempt"], done["failed_attempts"], done["result"]) == (5, 0, {"attempt": 5})
    assert done["error"] is None
    rows = await attempt_rows(pgtask_async_engine, task_id)
    assert [(r["attempt"], r["state"]) for r in rows] == [
        (1, "failed"), (2, "failed"), (3, "failed"), (4, "failed"), (5, "succeeded"),
    ]
    entries = audit(pgtask_engine, task_id=task_id)
    assert [(e.action, e.actor, e.reason) for e in entries] == [
        ("task.retry", "alice", None), ("task.retry", "alice", "fixed the bug"),
    ]
    assert entries[1].details == {"previous_state": "failed", "attempt": 2}
    assert entries[0].details == {"previous_state": "failed", "attempt": 4}
    assert {e.queue for e in entries} == {"default"}


async def test_a_task_cancelled_before_it_ran_is_retried_and_runs(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    task_id = await add(pgtask_async_engine, "job")
    with pgtask_engine.begin() as connection:
        assert cancel(connection, task_id) == "cancelled"
        assert retry(connection, task_id) == "cancelled"
    pending = full_row(pgtask_engine, task_id)
    assert pending["state"] == "pending"
    for cleared in ("error", "result", "completed_at", "cancel_requested_at", "lease_token"):
        assert pending[cleared] is None, cleared
    with pgtask_engine.connect() as connection:
        due = connection.scalar(select(Task.run_at <= func.pgtask.now()).where(Task.id == task_id))
    assert due

    async with running_worker(flaky_registry([]), pgtask_database_url, OPTIONS):
        await finished(pgtask_async_engine, task_id, "succeeded", 1)


async def test_a_task_cancelled_while_running_is_retried_and_runs_to_success(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    registry = Registry()
    started = threading.Event()
    runs: list[int] = []

    @registry.task("job")
    async def job(ctx: TaskContext, payload: Any) -> str:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            started.set()
            await asyncio.Event().wait()  # until the cancellation stops it
        return "done"

    async with running_worker(registry, pgtask_database_url, OPTIONS):
        task_id = await add(pgtask_async_engine, "job")
        await wait_event(started, PATIENCE)
        async with AsyncSession(pgtask_async_engine) as session:
            assert await cancel_async(session, task_id, actor="ops") == "running"
            await session.commit()
        await finished(pgtask_async_engine, task_id, "cancelled", 1)
        async with AsyncSession(pgtask_async_engine) as session:
            assert await retry_async(session, task_id, actor="ops") == "cancelled"
            await session.commit()
        await finished(pgtask_async_engine, task_id, "succeeded", 2)

    assert runs == [1, 2]
    rows = await attempt_rows(pgtask_async_engine, task_id)
    assert [(r["attempt"], r["state"]) for r in rows] == [(1, "cancelled"), (2, "succeeded")]
    assert [e.action for e in audit(pgtask_engine, task_id=task_id)] == [
        "task.retry", "task.cancel",
    ]


async def test_a_retried_durable_task_replays_its_checkpoints(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    registry = Registry()
    charged: list[int] = []

    def charge_once(attempt: int) -> int:
        charged.append(attempt)
        return len(charged)

    @registry.task("workflow", retry=NOW_AGAIN, max_attempts=1)
    async def workflow(ctx: TaskContext, payload: Any) -> dict[str, Any]:
        charge: int = await ctx.step("charge", lambda: charge_once(ctx.attempt))
        if ctx.attempt == 1:
            raise Fail("the shipment failed")
        return {"charge": charge, "attempt": ctx.attempt}

    async with running_worker(registry, pgtask_database_url, OPTIONS):
        task_id = await add(pgtask_async_engine, "workflow")
        await finished(pgtask_async_engine, task_id, "failed", 1)
        with pgtask_engine.begin() as connection:
            retry(connection, task_id)
        await finished(pgtask_async_engine, task_id, "succeeded", 2)

    assert charged == [1]  # the step ran once; the retry replayed its checkpoint
    assert (await task_row(pgtask_async_engine, task_id))["result"] == {
        "charge": 1, "attempt": 2,
    }


async def test_a_retried_workflow_finds_its_children_still_cancelled(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    registry = Registry()
    child_started = threading.Event()

    @registry.task("child")
    async def child(ctx: TaskContext, payload: Any) -> None:
        child_started.set()
        await asyncio.Event().wait()  # until the cascade cancels it

    @registry.task("parent")
    async def parent(ctx: TaskContext, payload: Any) -> dict[str, str]:
        kid = await ctx.spawn("kid", child)
        done = await ctx.wait_for_result("wait-kid", kid)
        return {"child": str(kid), "state": done.state}

    async with running_worker(registry, pgtask_database_url, OPTIONS):
        parent_id = await add(pgtask_async_engine, "parent")
        await wait_event(child_started, PATIENCE)
        await finished(pgtask_async_engine, parent_id, "waiting", 1)
        with pgtask_engine.begin() as connection:
            assert cancel(connection, parent_id) == "cancelled"
            [child_id] = connection.scalars(
                select(Task.id).where(Task.parent_id == parent_id)
            ).all()
        await finished(pgtask_async_engine, child_id, "cancelled", 1)
        with pgtask_engine.begin() as connection:
            retry(connection, parent_id)
        await finished(pgtask_async_engine, parent_id, "succeeded", 2)

    result = (await task_row(pgtask_async_engine, parent_id))["result"]
    assert result == {"child": str(child_id), "state": "cancelled"}  # the same child
    assert (await task_row(pgtask_async_engine, child_id))["state"] == "cancelled"
    assert len(await attempt_rows(pgtask_async_engine, child_id)) == 1  # it never ran again


# -- retry refuses, and writes nothing ---------------------------------------------------------


@pytest.mark.parametrize("state", ["pending", "running", "waiting", "succeeded"])
def test_retrying_a_task_that_is_not_failed_or_cancelled_is_refused_and_writes_nothing(
    pgtask_engine: Engine, state: str
) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
    if state != "pending":
        set_state(pgtask_engine, task_id, state)
    before = full_row(pgtask_engine, task_id)

    with Session(pgtask_engine) as session:
        with pytest.raises(TaskNotRetryable) as refused:
            retry(session, task_id, actor="alice")
        session.commit()

    assert (refused.value.task_id, refused.value.state) == (task_id, state)
    assert f"is {state}; only failed or cancelled tasks can be retried" in str(refused.value)
    assert full_row(pgtask_engine, task_id) == before
    assert count_audit(pgtask_engine) == 0


def test_retrying_an_unknown_task_raises_task_not_found_and_writes_nothing(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as connection, pytest.raises(TaskNotFound):
        retry(connection, uuid.uuid4())
    assert count_audit(pgtask_engine) == 0


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: retry(c, "not-a-uuid"), "task_id"),
        (lambda c: retry(c, uuid.uuid4(), actor=""), "actor"),
        (lambda c: retry(c, uuid.uuid4(), actor="x" * 256), "actor"),
        (lambda c: retry(c, uuid.uuid4(), actor="é" * 128), "actor"),  # 256 bytes
        (lambda c: retry(c, uuid.uuid4(), actor="a\x00b"), "actor"),
        (lambda c: retry(c, uuid.uuid4(), reason="r" * 1001), "reason"),
        (lambda c: retry(c, uuid.uuid4(), actor=7), "actor"),  # type: ignore[arg-type]
        (lambda c: cancel(c, uuid.uuid4(), actor=""), "actor"),
        (lambda c: cancel(c, uuid.uuid4(), reason=""), "reason"),
    ],
)
def test_bad_input_is_refused_before_any_sql(
    pgtask_engine: Engine, call: Callable[[Session], object], field: str
) -> None:
    with Session(pgtask_engine) as session:
        with pytest.raises(ValidationError) as refused:
            call(session)
        assert refused.value.field == field
        assert not session.in_transaction()


def test_the_longest_actor_and_reason_are_accepted(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
        cancel(connection, task_id, actor="é" * 127 + "a", reason="r" * 1000)
    [entry] = audit(pgtask_engine)
    assert (len(entry.actor.encode()), len(entry.reason or "")) == (255, 1000)


def test_a_retry_in_a_rolled_back_transaction_leaves_no_trace(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
        cancel(connection, task_id)
    before = full_row(pgtask_engine, task_id)
    entries = count_audit(pgtask_engine)

    with Session(pgtask_engine) as session:
        retry(session, task_id, actor="alice")
        assert session.get_one(Task, task_id).state == "pending"  # in the transaction
        assert len(list_audit(session)) == entries + 1
        session.rollback()

    assert full_row(pgtask_engine, task_id) == before
    assert count_audit(pgtask_engine) == entries


# -- concurrent retries ------------------------------------------------------------------------


def _concurrently(engine: Engine, task_id: uuid.UUID, count: int) -> list[object]:
    """``count`` threads, each on its own connection, retry ``task_id`` at once."""
    barrier = threading.Barrier(count)
    outcomes: list[object] = [None] * count

    def attempt(index: int) -> None:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))  # connected before the barrier
            barrier.wait(PATIENCE)
            try:
                outcomes[index] = retry(connection, task_id, actor=f"thread-{index}")
                connection.commit()
            except TaskNotRetryable as exc:
                outcomes[index] = exc
                connection.rollback()

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    return outcomes


def test_concurrent_retries_retry_the_task_once(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
        cancel(connection, task_id)

    outcomes = _concurrently(pgtask_engine, task_id, 8)

    assert outcomes.count("cancelled") == 1, outcomes
    refused = [o for o in outcomes if isinstance(o, TaskNotRetryable)]
    assert len(refused) == 7, outcomes
    assert {r.state for r in refused} == {"pending"}
    [entry] = [e for e in audit(pgtask_engine) if e.action == "task.retry"]
    winner = outcomes.index("cancelled")
    assert entry.actor == f"thread-{winner}"


def test_a_retry_waits_for_a_concurrent_one_and_then_sees_its_result(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
        cancel(connection, task_id)
    outcome: list[object] = []

    with pgtask_engine.connect() as first:
        retry(first, task_id)  # holds the row lock until it commits
        pid = first.scalar(text("SELECT pg_backend_pid()"))

        def second() -> None:
            with pgtask_engine.connect() as connection:
                try:
                    outcome.append(retry(connection, task_id))
                except TaskNotRetryable as exc:
                    outcome.append(exc)

        thread = threading.Thread(target=second)
        thread.start()

        def blocked_by_first() -> bool:
            with pgtask_engine.connect() as connection:
                return bool(connection.scalar(
                    text("SELECT count(*) FROM pg_stat_activity"
                         " WHERE :pid = ANY(pg_blocking_pids(pid))"),
                    {"pid": pid},
                ))

        wait_until(blocked_by_first, PATIENCE, message="the second retry to wait for the lock")
        first.commit()
        thread.join(PATIENCE)

    [refused] = outcome
    assert isinstance(refused, TaskNotRetryable)
    assert refused.state == "pending"
    assert [e.action for e in audit(pgtask_engine)] == ["task.retry", "task.cancel"]


# -- idempotency keys --------------------------------------------------------------------------


def test_a_retried_tasks_idempotency_key_is_reserved_again(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "default", idempotency_retention_seconds=60)
        task_id = enqueue(connection, "job", idempotency_key="order-7").id
        cancel(connection, task_id)
    pgtask_clock.advance(120)  # the key has expired (but nobody took it yet)
    with pgtask_engine.begin() as connection:
        retry(connection, task_id)

    # While its task is unfinished, a key never expires: the duplicate gets the retried task.
    with pgtask_engine.begin() as connection:
        duplicate = enqueue(connection, "job", idempotency_key="order-7")
    assert (duplicate.id, duplicate.created) == (task_id, False)


def test_without_the_retry_the_expired_key_goes_to_a_new_task(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    # The control for the test above: the same steps without retry create a new task.
    with pgtask_engine.begin() as connection:
        configure_queue(connection, "default", idempotency_retention_seconds=60)
        task_id = enqueue(connection, "job", idempotency_key="order-7").id
        cancel(connection, task_id)
    pgtask_clock.advance(120)
    with pgtask_engine.begin() as connection:
        duplicate = enqueue(connection, "job", idempotency_key="order-7")
    assert duplicate.created
    assert duplicate.id != task_id


# -- cancel is audited -------------------------------------------------------------------------


def test_cancel_is_audited_only_when_it_changes_something(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        pending = enqueue(connection, "job", queue="emails").id
        running = enqueue(connection, "job").id
    set_state(pgtask_engine, running, "running")

    with pgtask_engine.begin() as connection:
        assert cancel(connection, pending, actor="alice", reason="duplicate") == "cancelled"
        assert cancel(connection, pending, actor="alice") is None  # finished: nothing
        assert cancel(connection, running, actor="bob") == "running"
        assert cancel(connection, running, actor="bob") == "running"  # already requested
        assert cancel(connection, uuid.uuid4(), actor="bob") is None

    entries = audit(pgtask_engine)
    assert [(e.action, e.task_id, e.queue, e.actor, e.reason, e.details) for e in entries] == [
        ("task.cancel", running, "default", "bob", None,
         {"previous_state": "running", "state": "running"}),
        ("task.cancel", pending, "emails", "alice", "duplicate",
         {"previous_state": "pending", "state": "cancelled"}),
    ]


def test_without_an_actor_the_database_role_is_recorded(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
        cancel(connection, task_id)
        retry(connection, task_id)
        role = connection.scalar(text("SELECT current_user"))
    assert [e.actor for e in audit(pgtask_engine)] == [role, role]


def test_a_cancel_rolled_back_leaves_no_audit_entry(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job").id
    with pgtask_engine.connect() as connection:
        cancel(connection, task_id, actor="alice")
        connection.rollback()
    assert count_audit(pgtask_engine) == 0
    assert full_row(pgtask_engine, task_id)["state"] == "pending"


async def test_the_async_twins_audit_in_the_callers_transaction(
    pgtask_async_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    task_id = await add(pgtask_async_engine, "job")
    async with pgtask_async_engine.connect() as connection:
        assert await cancel_async(connection, task_id, actor="a", reason="r") == "cancelled"
        assert await retry_async(connection, task_id, actor="a") == "cancelled"
        await connection.rollback()
    assert count_audit(pgtask_engine) == 0
    async with pgtask_async_engine.begin() as connection:
        await cancel_async(connection, task_id, actor="a")
        await retry_async(connection, str(task_id), actor="b")
        with pytest.raises(TaskNotRetryable):
            await retry_async(connection, task_id)
    # The refused retry aborted nothing: it raised before any failing statement.
    assert [e.actor for e in audit(pgtask_engine)] == ["b", "a"]


def test_wrong_binds_are_type_errors(pgtask_engine: Engine) -> None:
    with pytest.raises(TypeError, match="retry_async"):
        retry(AsyncSession(), uuid.uuid4())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no transaction to join"):
        retry(pgtask_engine, uuid.uuid4())  # type: ignore[arg-type]
