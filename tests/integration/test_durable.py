"""Durable execution end to end: steps, sleeps, signals, children and fenced transactions.

Each test runs a real worker against its own database. Replays are forced by a handler that
fails once after its durable calls (the retry replays them) or by a suspension (the resumed
attempt replays everything before it). Time moves with the database clock, never a sleep.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

from sqlalchemy import Column, Integer, MetaData, Table, Text, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    Checkpoint,
    ChildResult,
    InvalidOptionError,
    PayloadError,
    Registry,
    ReplayMismatch,
    Retry,
    RetryPolicy,
    Suspended,
    SyncTaskContext,
    TaskContext,
    WorkerOptions,
    emit_signal_async,
)
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
AGAIN = RetryPolicy.fixed(0.0, jitter=False)

app_metadata = MetaData()
orders = Table(
    "orders", app_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("note", Text, nullable=False),
)


async def checkpoints(engine: AsyncEngine, task_id: uuid.UUID) -> dict[tuple[str, int], Any]:
    """The task's checkpoints: (step, occurrence) -> (kind, value)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(
                Checkpoint.step, Checkpoint.occurrence, Checkpoint.kind, Checkpoint.value
            ).where(Checkpoint.task_id == task_id)
        )
        return {(row.step, row.occurrence): (row.kind, row.value) for row in rows}


async def suspended(engine: AsyncEngine, task_id: uuid.UUID, attempts: int = 1) -> dict[str, Any]:
    """Wait until the task's ``attempts``-th attempt ended suspended; return the task's row."""

    async def done() -> bool:
        rows = await attempt_rows(engine, task_id)
        return len(rows) >= attempts and rows[attempts - 1]["state"] == "suspended"

    await wait_until(done, PATIENCE, message=f"attempt {attempts} of {task_id} suspended")
    return await task_row(engine, task_id)


async def test_a_step_runs_once_and_its_stored_value_is_replayed_by_the_retry(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    calls: Counter[str] = Counter()
    registry = Registry()

    @registry.task("twice", retry=AGAIN, max_attempts=3)
    async def twice(ctx: TaskContext, payload: None) -> list[Any]:
        async def charge() -> dict[str, Any]:
            calls["charge"] += 1
            return {"charged": 42, "at": (1, 2)}

        first = await ctx.step("charge", charge)
        second = await ctx.step("charge", lambda: calls.update(["again"]) or "x", occurrence=1)
        if ctx.attempt == 1:
            raise RuntimeError("fail after the steps")
        return [first, second]

    task_id = await add(pgtask_async_engine, "twice")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    assert calls == Counter({"charge": 1, "again": 1})
    # The JSON form, on the first run and the replay alike: a tuple reads back as a list.
    assert row["result"] == [{"charged": 42, "at": [1, 2]}, "x"]
    stored = await checkpoints(pgtask_async_engine, task_id)
    assert stored == {
        ("charge", 0): ("step", {"charged": 42, "at": [1, 2]}),
        ("charge", 1): ("step", "x"),
    }


async def test_sync_handlers_have_the_same_steps(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    calls: Counter[str] = Counter()
    registry = Registry()

    @registry.task("sync-steps", retry=AGAIN, max_attempts=3)
    def sync_steps(ctx: SyncTaskContext, payload: None) -> int:
        def work() -> int:
            calls["work"] += 1
            return 7

        value = ctx.step("work", work)
        if ctx.attempt == 1:
            raise RuntimeError("retry me")
        return value * 6

    task_id = await add(pgtask_async_engine, "sync-steps")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"], calls["work"]) == ("succeeded", 42, 1)


async def test_an_unstorable_step_result_is_a_clear_error_and_stores_nothing(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    seen: list[BaseException] = []
    registry = Registry()

    @registry.task("bad-step", retry=RetryPolicy.never())
    async def bad_step(ctx: TaskContext, payload: None) -> None:
        for value in ({1, 2}, "x" * (1024 * 1024 + 1)):
            try:
                await ctx.step(f"bad-{len(seen)}", lambda v=value: v)  # type: ignore[misc]
            except PayloadError as exc:
                seen.append(exc)

    task_id = await add(pgtask_async_engine, "bad-step")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    assert [type(e) for e in seen] == [PayloadError, PayloadError]
    assert "not JSON" in str(seen[0])
    assert "bytes" in str(seen[1])
    assert await checkpoints(pgtask_async_engine, task_id) == {}


async def test_a_step_key_used_twice_in_one_run_is_refused(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("dup", retry=RetryPolicy.never())
    async def dup(ctx: TaskContext, payload: None) -> None:
        await ctx.step("a", lambda: 1)
        await ctx.step("a", lambda: 2)

    task_id = await add(pgtask_async_engine, "dup")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "failed"
    assert row["error"]["exception"].endswith("InvalidOptionError")
    assert "already used in this run" in row["error"]["message"]


async def test_a_durable_sleep_frees_the_slot_and_wakes_at_database_time(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    calls: Counter[str] = Counter()
    registry = Registry()

    @registry.task("sleeper", max_attempts=1)
    async def sleeper(ctx: TaskContext, payload: None) -> str:
        calls["before"] += 1
        await ctx.step("prepare", lambda: calls.update(["prepare"]) or "ready")
        await ctx.sleep_for("nap", 3600)
        calls["after"] += 1
        return "woke"

    task_id = await add(pgtask_async_engine, "sleeper")
    async with running_worker(registry, pgtask_database_url, OPTIONS) as worker:
        row = await suspended(pgtask_async_engine, task_id)
        assert (row["state"], row["attempt"], row["lease_token"]) == ("pending", 1, None)
        assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
            "suspended"
        ]
        # The wake time is database time: an hour after the sleep began.
        stored = await checkpoints(pgtask_async_engine, task_id)
        assert stored[("nap", 0)][0] == "sleep"
        assert row["run_at"] > row["updated_at"]
        assert worker.running_count == 0
        pgtask_clock.advance(3600)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    assert row["result"] == "woke"
    assert row["failed_attempts"] == 0
    assert calls == Counter({"before": 2, "prepare": 1, "after": 1})


async def test_a_sleep_into_the_past_does_not_suspend(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("no-nap")
    async def no_nap(ctx: TaskContext, payload: None) -> int:
        await ctx.sleep_for("zero", 0)
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "no-nap")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", 1)


async def test_suspensions_never_consume_the_retry_budget(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("many-naps", max_attempts=1)
    async def many_naps(ctx: TaskContext, payload: None) -> int:
        for i in range(4):
            await ctx.sleep_for("nap", 0.05, occurrence=i)
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "many-naps")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    assert row["result"] >= 2
    assert row["failed_attempts"] == 0


async def test_a_broad_except_cannot_swallow_a_suspension(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    swallowed: list[str] = []
    registry = Registry()

    @registry.task("swallower", max_attempts=1)
    async def swallower(ctx: TaskContext, payload: None) -> str:
        try:
            await ctx.sleep_for("nap", 3600)
        except Exception:
            swallowed.append("exception")
        return "done"

    task_id = await add(pgtask_async_engine, "swallower")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await suspended(pgtask_async_engine, task_id)
        assert row["result"] is None
        pgtask_clock.advance(3601)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    assert swallowed == []
    assert issubclass(Suspended, BaseException)
    assert not issubclass(Suspended, Exception)


async def test_a_signal_wakes_its_waiter_and_the_first_value_wins(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("approval", max_attempts=1)
    async def approval(ctx: TaskContext, payload: None) -> Any:
        return await ctx.wait_for_signal("approve", "approved")

    task_id = await add(pgtask_async_engine, "approval")
    async with running_worker(registry, pgtask_database_url, OPTIONS) as worker:
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
        assert worker.running_count == 0
        async with pgtask_async_engine.begin() as conn:
            assert await emit_signal_async(conn, task_id, "approved", {"by": "ann"}) == {
                "by": "ann"
            }
        async with pgtask_async_engine.begin() as conn:
            assert await emit_signal_async(conn, task_id, "approved", {"by": "bob"}) == {
                "by": "ann"
            }
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", {"by": "ann"})


async def test_a_signal_sent_before_the_wait_is_returned_at_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("early", max_attempts=1)
    async def early(ctx: TaskContext, payload: None) -> Any:
        return [ctx.attempt, await ctx.wait_for_signal("go", "go", signal_occurrence=3)]

    task_id = await add(pgtask_async_engine, "early")
    async with pgtask_async_engine.begin() as conn:
        await emit_signal_async(conn, task_id, "go", "now", occurrence=3)
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", [1, "now"])


async def test_a_signal_wait_times_out_at_its_database_deadline(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("impatient", max_attempts=1)
    async def impatient(ctx: TaskContext, payload: None) -> Any:
        return {"got": await ctx.wait_for_signal("approve", "approved", timeout=3600)}

    task_id = await add(pgtask_async_engine, "impatient")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
        pgtask_clock.advance(3601)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", {"got": None})
    # A signal arriving after the timeout changes nothing.
    async with pgtask_async_engine.begin() as conn:
        await emit_signal_async(conn, task_id, "approved", True)
    assert (await task_row(pgtask_async_engine, task_id))["result"] == {"got": None}


async def test_a_child_is_spawned_once_and_its_result_wakes_the_parent(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    spawned: list[uuid.UUID] = []
    registry = Registry()

    @registry.task("ship")
    async def ship(ctx: TaskContext, payload: dict[str, int]) -> str:
        return f"shipped {payload['order']}"

    @registry.task("order", retry=AGAIN, max_attempts=3)
    async def order(ctx: TaskContext, payload: None) -> Any:
        child = await ctx.spawn("spawn-ship", ship, {"order": 7})
        spawned.append(child)
        if ctx.attempt == 1:
            raise Retry("replay the spawn")
        result = await ctx.wait_for_result("wait-ship", child)
        return [result.state, result.result, str(child)]

    task_id = await add(pgtask_async_engine, "order")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded", row["error"]
    assert len(set(spawned)) == 1
    assert row["result"] == ["succeeded", "shipped 7", str(spawned[0])]
    child = await task_row(pgtask_async_engine, spawned[0])
    assert child["parent_id"] == task_id
    async with pgtask_async_engine.connect() as conn:
        children = (
            await conn.execute(select(func.count()).where(
                Checkpoint.task_id == task_id, Checkpoint.kind == "spawn"
            ))
        ).scalar_one()
    assert children == 1


async def test_waiting_for_a_task_that_is_not_a_direct_child_is_refused(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    stranger = await add(pgtask_async_engine, "nobody-runs-this")
    errors: list[BaseException] = []
    registry = Registry()

    @registry.task("nosy", retry=RetryPolicy.never())
    async def nosy(ctx: TaskContext, payload: str) -> None:
        try:
            await ctx.wait_for_result("peek", payload)
        except InvalidOptionError as exc:
            errors.append(exc)

    task_id = await add(pgtask_async_engine, "nosy", str(stranger))
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert len(errors) == 1
    assert "not a direct child" in str(errors[0])


async def test_a_child_result_wait_times_out_and_cancels_the_child_subtree(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("slow-child")
    async def slow_child(ctx: TaskContext, payload: None) -> None:
        await ctx.spawn("grandchild", "never-runs")
        await ctx.wait_for_signal("forever", "never")

    @registry.task("parent", max_attempts=1)
    async def parent(ctx: TaskContext, payload: None) -> Any:
        child = await ctx.spawn("child", slow_child)
        outcome: ChildResult = await ctx.wait_for_result("wait", child, timeout=3600)
        return [outcome.state, str(child)]

    task_id = await add(pgtask_async_engine, "parent")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)

        async def child_waits() -> bool:
            async with pgtask_async_engine.connect() as conn:
                spawned = (await conn.execute(
                    select(func.count())
                    .select_from(Checkpoint)
                    .where(Checkpoint.step == "grandchild")
                )).scalar_one()
            return bool(spawned)

        await wait_until(child_waits, PATIENCE, message="the child spawned its own child")
        pgtask_clock.advance(3601)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    state, child_id = row["result"]
    assert state == "timeout"
    child = await task_row(pgtask_async_engine, uuid.UUID(child_id))
    assert child["state"] == "cancelled"
    assert child["error"]["reason"] == "result_wait_timeout"


async def test_the_fenced_transaction_commits_business_rows_exactly_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    registry = Registry()

    @registry.task("create-order", retry=AGAIN, max_attempts=3)
    async def create_order(ctx: TaskContext, payload: None) -> Any:
        tx = ctx.transaction("insert")
        async with tx as session:
            inserted = await session.execute(
                orders.insert().values(note=f"attempt {ctx.attempt}").returning(orders.c.id)
            )
            tx.result = {"order_id": inserted.scalar_one()}
        if ctx.attempt == 1:
            raise RuntimeError("crash after the transaction")
        return [tx.result, tx.replayed]

    task_id = await add(pgtask_async_engine, "create-order")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded", row["error"]
    async with pgtask_async_engine.connect() as conn:
        rows = (await conn.execute(select(orders.c.id, orders.c.note))).all()
    assert [tuple(r) for r in rows] == [(row["result"][0]["order_id"], "attempt 1")]
    assert row["result"][1] is True


async def test_the_sync_fenced_transaction_commits_business_rows_exactly_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    registry = Registry()

    @registry.task("create-order-sync", retry=AGAIN, max_attempts=3)
    def create_order(ctx: SyncTaskContext, payload: None) -> Any:
        tx = ctx.transaction("insert")
        with tx as session:
            session.execute(orders.insert().values(note=f"attempt {ctx.attempt}"))
            tx.result = "inserted"
        if ctx.attempt == 1:
            raise RuntimeError("crash after the transaction")
        return [tx.result, tx.replayed]

    task_id = await add(pgtask_async_engine, "create-order-sync")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == ["inserted", True]
    async with pgtask_async_engine.connect() as conn:
        notes = (await conn.execute(select(orders.c.note))).scalars().all()
    assert notes == ["attempt 1"]


async def test_a_changed_step_kind_is_a_replay_mismatch(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()
    first_run = threading.Event()

    @registry.task("shifty", retry=AGAIN, max_attempts=2)
    async def shifty(ctx: TaskContext, payload: None) -> None:
        if not first_run.is_set():
            first_run.set()
            await ctx.step("x", lambda: 1)
            raise RuntimeError("again")
        await ctx.sleep_for("x", 1)

    task_id = await add(pgtask_async_engine, "shifty")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "failed"
    assert row["error"]["exception"] == f"{ReplayMismatch.__module__}.ReplayMismatch"



