"""Cancelling tasks and waiting for their results, against a real worker and database.

``cancel`` runs in the caller's transaction: a pending task is cancelled at once, a running one
only has its cancellation requested, which its worker sees at its next lease renewal (every
third of the lease). The waiters return the terminal task, woken by the ``pgtask_result``
notification or, when none comes, by their own poll.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Attempt,
    BaseTaskContext,
    InvalidOptionError,
    Registry,
    SyncTaskContext,
    Task,
    TaskContext,
    TaskNotFound,
    WorkerOptions,
    cancel,
    cancel_async,
    enqueue,
    get_task,
    get_task_async,
    statements,
    wait_for_result,
    wait_for_result_async,
)
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import add, task_row, wait_for_state
from tests.support.urls import libpq_url
from tests.support.waiting import PATIENCE, SLOW_POLL, wait_event

LEASE = 1.5
OPTIONS = WorkerOptions(lease_duration=LEASE, shutdown_grace=2.0)


async def attempt_states(engine: AsyncEngine, task_id: uuid.UUID) -> list[str]:
    async with engine.connect() as conn:
        return list(
            (
                await conn.execute(
                    select(Attempt.state)
                    .where(Attempt.task_id == task_id)
                    .order_by(Attempt.attempt)
                )
            ).scalars()
        )


async def request_cancel(engine: AsyncEngine, task_id: uuid.UUID) -> str | None:
    async with engine.begin() as conn:
        return await cancel_async(conn, task_id)


class RenewalWatch:
    """Watches the lease renewals a worker on ``engine`` begins after `start` is called.

    For each one it notes whether the handler (its `TaskContext`, once `handler` is set) had
    already been told to stop when that renewal began. A cancellation delivered by the first
    renewal after the request shows as ``[False]`` (or ``[]`` when a renewal already under way
    at the request delivered it), followed by nothing but ``True``.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.handler: BaseTaskContext | None = None
        self.seen: list[bool] = []
        self._watching = False
        event.listen(engine.sync_engine, "before_cursor_execute", self._on_execute)

    def start(self) -> None:
        self._watching = True

    def _on_execute(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
        executemany: bool,
    ) -> None:
        compiled = getattr(context, "compiled", None)
        if self._watching and compiled is not None and compiled.statement is statements.RENEW:
            assert self.handler is not None
            self.seen.append(self.handler.cancelled)

    def assert_stopped_by_the_next_renewal(self) -> None:
        assert self.handler is not None
        assert self.handler.stop_reason == "cancelled"  # only a renewal tells a running handler
        assert False not in self.seen[1:], (
            f"renewals after the cancel request, handler told to stop yet: {self.seen}"
        )


# -- cancel --------------------------------------------------------------------------------


async def test_cancelling_a_pending_task_cancels_it_at_once_and_it_never_runs(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    ran: list[Any] = []

    @registry.task("job")
    async def job(ctx: TaskContext, payload: str) -> None:
        ran.append(payload)

    task_id = await add(pgtask_async_engine, "job", "cancelled")
    assert await request_cancel(pgtask_async_engine, task_id) == "cancelled"
    row = await task_row(pgtask_async_engine, task_id)
    assert row["state"] == "cancelled"
    assert row["error"] == {"type": "cancelled"}
    assert row["cancel_requested_at"] is not None
    assert row["completed_at"] == row["cancel_requested_at"]

    # Enqueued after it: once this one ran, the cancelled one would have run first.
    sentinel = await add(pgtask_async_engine, "job", "sentinel")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, sentinel)
    assert ran == ["sentinel"]
    after = await task_row(pgtask_async_engine, task_id)
    assert after == row
    assert after["attempt"] == 0
    assert await attempt_states(pgtask_async_engine, task_id) == []


def test_cancel_joins_the_callers_transaction_and_never_commits(pgtask_engine: Engine) -> None:
    with Session(pgtask_engine) as session:
        task_id = enqueue(session, "job").id
        session.commit()
        assert cancel(session, task_id) == "cancelled"
        session.rollback()  # the caller changed its mind
    with Session(pgtask_engine) as session:
        task = get_task(session, task_id)
        assert task is not None
        assert (task.state, task.cancel_requested_at) == ("pending", None)
        assert cancel(session, str(task_id)) == "cancelled"  # ids may be strings
        session.commit()
        session.refresh(task)
        assert task.state == "cancelled"


async def test_cancelling_a_running_async_handler_stops_it_within_a_third_of_the_lease(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    started, stopped = asyncio.Event(), asyncio.Event()
    renewals = RenewalWatch(pgtask_async_engine)

    @registry.task("long")
    async def long(ctx: TaskContext, payload: None) -> str:
        renewals.handler = ctx
        started.set()
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 2 * PATIENCE)
        except asyncio.CancelledError:
            stopped.set()
            raise
        return "should not get here"

    task_id = await add(pgtask_async_engine, "long", max_attempts=3)
    async with running_worker(registry, pgtask_async_engine, OPTIONS):
        await wait_event(started, PATIENCE)
        assert await request_cancel(pgtask_async_engine, task_id) == "running"
        renewals.start()
        # Still running: the request is recorded, the handler is stopped by its worker.
        row = await task_row(pgtask_async_engine, task_id)
        assert (row["state"], row["completed_at"]) == ("running", None)
        assert row["cancel_requested_at"] is not None
        await wait_event(stopped, PATIENCE)
        final = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    # Renewal runs every lease/3, and the first one after the request stopped the handler: no
    # later renewal found it still going (however long each took on a busy machine).
    renewals.assert_stopped_by_the_next_renewal()
    assert final["state"] == "cancelled"
    assert (final["result"], final["error"]) == (None, {"type": "cancelled"})
    assert (final["attempt"], final["failed_attempts"]) == (1, 0)
    assert final["lease_token"] is None
    assert await attempt_states(pgtask_async_engine, task_id) == ["cancelled"]


async def test_cancelling_a_running_sync_handler_sets_ctx_cancelled_and_check_raises(
    pgtask_async_engine: AsyncEngine,
) -> None:
    registry = Registry()
    started = threading.Event()
    seen: dict[str, Any] = {}
    renewals = RenewalWatch(pgtask_async_engine)

    @registry.task("long-sync")
    def long_sync(ctx: SyncTaskContext, payload: None) -> str:
        renewals.handler = ctx
        started.set()
        deadline = time.monotonic() + 2 * PATIENCE
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler's own unit of work
        seen["reason"] = ctx.stop_reason
        ctx.check()  # raises TaskCancelled
        return "should not get here"

    task_id = await add(pgtask_async_engine, "long-sync")
    async with running_worker(registry, pgtask_async_engine, OPTIONS):
        await wait_event(started, PATIENCE)
        assert await request_cancel(pgtask_async_engine, task_id) == "running"
        renewals.start()
        final = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert seen["reason"] == "cancelled"
    renewals.assert_stopped_by_the_next_renewal()
    assert (final["state"], final["result"], final["failed_attempts"]) == ("cancelled", None, 0)
    assert await attempt_states(pgtask_async_engine, task_id) == ["cancelled"]


async def test_a_success_returned_after_the_cancel_request_is_not_recorded(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    started, go = threading.Event(), threading.Event()

    @registry.task("stubborn")
    def stubborn(ctx: SyncTaskContext, payload: None) -> dict[str, bool]:
        started.set()
        go.wait(timeout=10)  # ignores ctx entirely
        return {"done": True}

    task_id = await add(pgtask_async_engine, "stubborn")
    try:
        async with running_worker(registry, pgtask_database_url, OPTIONS):
            await wait_event(started)
            assert await request_cancel(pgtask_async_engine, task_id) == "running"
            go.set()  # the handler now returns its success, after the request
            final = await wait_for_state(pgtask_async_engine, task_id)
    finally:
        go.set()
    assert final["state"] == "cancelled"
    assert final["result"] is None
    assert final["error"] == {"type": "cancelled"}
    assert await attempt_states(pgtask_async_engine, task_id) == ["cancelled"]


async def test_cancelling_a_finished_or_unknown_task_returns_none_and_changes_nothing(
    pgtask_async_engine: AsyncEngine,
) -> None:
    done = await add(pgtask_async_engine, "job")
    async with pgtask_async_engine.begin() as conn:
        await conn.execute(
            update(Task).where(Task.id == done).values(
                state="succeeded", result=42, completed_at=text("statement_timestamp()")
            )
        )
    cancelled = await add(pgtask_async_engine, "job")
    assert await request_cancel(pgtask_async_engine, cancelled) == "cancelled"
    before = {i: await task_row(pgtask_async_engine, i) for i in (done, cancelled)}
    assert await request_cancel(pgtask_async_engine, done) is None
    assert await request_cancel(pgtask_async_engine, uuid.uuid4()) is None
    async with AsyncSession(pgtask_async_engine) as session:  # sessions work too
        assert await cancel_async(session, cancelled) is None
        assert await cancel_async(session, str(done)) is None
        await session.commit()
    for task_id, row in before.items():
        assert await task_row(pgtask_async_engine, task_id) == row


# -- get_task ------------------------------------------------------------------------------


async def test_get_task_returns_the_task_or_none(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "job", {"order": 7}, priority=3)
    with Session(pgtask_engine) as session:
        task = get_task(session, task_id)
        assert task is not None
        assert (task.name, task.payload, task.priority, task.state) == (
            "job", {"order": 7}, 3, "pending",
        )
        assert get_task(session, str(task_id)) is task
        assert get_task(session, uuid.uuid4()) is None
        with pytest.raises(InvalidOptionError):
            get_task(session, "not-a-uuid")
    async with AsyncSession(pgtask_async_engine) as session:
        found = await get_task_async(session, task_id)
        assert found is not None
        assert found.payload == {"order": 7}
        assert await get_task_async(session, uuid.uuid4()) is None


# -- waiting for results -------------------------------------------------------------------


async def test_wait_for_result_returns_the_terminal_task_once_a_worker_finishes_it(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    go = asyncio.Event()

    @registry.task("answer")
    async def answer(ctx: TaskContext, payload: int) -> dict[str, int]:
        await asyncio.wait_for(go.wait(), PATIENCE)
        return {"answer": payload}

    sync_id = await add(pgtask_async_engine, "answer", 41)
    async_id = await add(pgtask_async_engine, "answer", 42)
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        # Their poll is far longer than the deadline below (and each one's own timeout, after
        # which it would read once more): returning within it means the notification woke them.
        sync_waiter = asyncio.create_task(
            asyncio.to_thread(wait_for_result, pgtask_engine, sync_id, timeout=2 * PATIENCE,
                              poll_interval=SLOW_POLL)
        )
        async_waiter = asyncio.create_task(
            wait_for_result_async(pgtask_async_engine, async_id, timeout=2 * PATIENCE,
                                  poll_interval=SLOW_POLL)
        )
        await wait_for_state(pgtask_async_engine, sync_id, ("running",))
        await wait_for_state(pgtask_async_engine, async_id, ("running",))
        assert not sync_waiter.done()
        assert not async_waiter.done()
        go.set()
        sync_task, async_task = await asyncio.wait_for(
            asyncio.gather(sync_waiter, async_waiter), PATIENCE
        )
    # Detached and fully loaded: readable after its session closed.
    assert (sync_task.id, sync_task.state, sync_task.result) == (
        sync_id, "succeeded", {"answer": 41},
    )
    assert (async_task.id, async_task.state, async_task.result) == (
        async_id, "succeeded", {"answer": 42},
    )
    assert isinstance(async_task.completed_at, datetime)
    assert sync_task.error is None


async def test_wait_for_result_returns_failed_and_cancelled_tasks_too(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "job")
    assert await request_cancel(pgtask_async_engine, task_id) == "cancelled"
    task = await wait_for_result_async(pgtask_async_engine, task_id, timeout=5)
    assert (task.state, task.error) == ("cancelled", {"type": "cancelled"})
    task = await asyncio.to_thread(wait_for_result, pgtask_engine, task_id, timeout=5)
    assert task.state == "cancelled"


async def test_waiting_times_out_on_a_task_that_does_not_finish(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "nobody-runs-this")
    # The timeout bounds the wait even with a poll interval far longer than the deadline: the
    # TimeoutError is the waiter's own (its message), not the deadline's.
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.3 s"):
        await asyncio.wait_for(
            wait_for_result_async(
                pgtask_async_engine, task_id, timeout=0.3, poll_interval=SLOW_POLL
            ),
            PATIENCE,
        )
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.3 s"):
        await asyncio.wait_for(
            asyncio.to_thread(
                wait_for_result, pgtask_engine, task_id, timeout=0.3, poll_interval=SLOW_POLL
            ),
            PATIENCE,
        )


async def test_waiting_for_an_unknown_task_raises_task_not_found(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    with pytest.raises(TaskNotFound):
        await wait_for_result_async(pgtask_async_engine, uuid.uuid4(), timeout=5)
    with pytest.raises(TaskNotFound):
        await asyncio.to_thread(wait_for_result, pgtask_engine, uuid.uuid4(), timeout=5)
    with pytest.raises(InvalidOptionError):
        await wait_for_result_async(pgtask_async_engine, "not-a-uuid", timeout=5)


def finish_without_notification(engine: Engine, task_id: uuid.UUID) -> None:
    """Mark a task succeeded with its triggers disabled, so no NOTIFY is ever sent.

    ``session_replication_role = replica`` (superuser only, which the test server's role is)
    disables ordinary triggers for the transaction, among them ``tasks_terminal_changed``,
    which sends the ``pgtask_result`` notification: a stand-in for a lost notification.
    """
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(
            update(Task)
            .where(Task.id == task_id)
            .values(
                state="succeeded",
                result={"silent": True},
                completed_at=text("statement_timestamp()"),
            )
        )


def assert_no_notification_for(url: str, task_id: uuid.UUID, finish: Callable[[], None]) -> None:
    """Run ``finish`` and prove it sent no ``pgtask_result`` notification for the task.

    A sentinel notified afterwards from another transaction arrives after anything the
    finishing transaction sent (notifications are delivered in commit order).
    """
    with psycopg.connect(libpq_url(url), autocommit=True) as listener:
        listener.execute("LISTEN pgtask_result")
        finish()
        with psycopg.connect(libpq_url(url), autocommit=True) as other:
            other.execute("SELECT pg_notify('pgtask_result', 'sentinel')")
        payloads = []
        for notification in listener.notifies(timeout=5):
            payloads.append(notification.payload)
            if notification.payload == "sentinel":
                break
    assert payloads == ["sentinel"], f"a notification for {task_id} was sent"


def count_task_reads(engine: Engine) -> tuple[list[str], threading.Event]:
    reads: list[str] = []
    first = threading.Event()

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "pgtask.tasks" in statement:
            reads.append(statement)
            first.set()

    event.listen(engine, "after_cursor_execute", on_execute)
    return reads, first


def test_wait_for_result_polls_when_the_notification_never_comes(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as conn:
        task_id = enqueue(conn, "job").id
    reads, first_read = count_task_reads(pgtask_engine)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            # Its timeout (after which it reads once more) is far beyond the join below.
            outcome["task"] = wait_for_result(
                pgtask_engine, task_id, timeout=2 * PATIENCE, poll_interval=0.05
            )
        except BaseException as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        assert first_read.wait(PATIENCE), "the waiter never read the task"
        assert "task" not in outcome  # it found the task pending and is waiting now
        assert_no_notification_for(
            pgtask_database_url, task_id,
            lambda: finish_without_notification(pgtask_engine, task_id),
        )
    finally:
        waiter.join(PATIENCE)
    assert not waiter.is_alive(), "the waiter did not find the task by polling"
    assert "error" not in outcome, outcome.get("error")
    assert (outcome["task"].state, outcome["task"].result) == ("succeeded", {"silent": True})
    # Found by reading again, unprompted (no notification was sent), not at the timeout.
    assert len(reads) >= 2


async def test_wait_for_result_async_polls_when_the_notification_never_comes(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "job")
    reads, first_read = count_task_reads(pgtask_async_engine.sync_engine)
    # Its timeout (after which it reads once more) is far beyond the deadline below.
    waiter = asyncio.create_task(
        wait_for_result_async(pgtask_async_engine, task_id, timeout=2 * PATIENCE,
                              poll_interval=0.05)
    )
    await wait_event(first_read, PATIENCE)
    assert not waiter.done()
    await asyncio.to_thread(
        assert_no_notification_for, pgtask_database_url, task_id,
        lambda: finish_without_notification(pgtask_engine, task_id),
    )
    task = await asyncio.wait_for(waiter, PATIENCE)  # found by a poll, not at the timeout
    assert (task.state, task.result) == ("succeeded", {"silent": True})
    assert len(reads) >= 2
