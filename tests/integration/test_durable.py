"""Durable execution end to end: steps, sleeps, signals, children and fenced transactions.

Each test runs a real worker against its own database. Replays are forced by a handler that
fails once after its durable calls (the retry replays them) or by a suspension (the resumed
attempt replays everything before it). Time moves with the database clock, never a sleep.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, Text, func, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Checkpoint,
    ChildResult,
    InvalidOptionError,
    LeaseLost,
    PayloadError,
    Registry,
    ReplayMismatch,
    Retry,
    RetryPolicy,
    Signal,
    Suspended,
    SyncTaskContext,
    Task,
    TaskContext,
    TaskNotFound,
    ValidationError,
    Wait,
    WorkerOptions,
    cancel_async,
    emit_signal,
    emit_signal_async,
    enqueue,
    statements,
)
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE, wait_event

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


async def expire_and_recover(engine: AsyncEngine, task_id: uuid.UUID) -> None:
    """End the running attempt's lease now and recover the task, as a dead worker's would be:
    its next attempt may start while the stale one still runs."""
    async with engine.begin() as conn:
        await conn.execute(
            update(Task).where(Task.id == task_id).values(
                lease_expires_at=func.pgtask.now() - text("interval '1 second'")
            )
        )
        assert len((await conn.execute(statements.RECOVER, {"limit": 10})).all()) == 1


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


def shape(value: Any) -> Any:
    """What ``==`` overlooks: each value's type and each object's key order."""
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__, value


# Python writes 1e16 in exponent form, which jsonb keeps as the integer it is; jsonb orders an
# object's keys shortest first. The first run used to see Python's reading of what it wrote.
AWKWARD = {"zz": 1e16, "a": 2.5, "b": [1e-7, {"yy": 1, "x": 2}]}


async def test_the_first_run_sees_a_stored_value_exactly_as_its_replays_do(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    seen: dict[str, list[Any]] = {}
    registry = Registry()

    @registry.task("awkward", retry=AGAIN, max_attempts=3)
    async def awkward(ctx: TaskContext, payload: None) -> None:
        value = await ctx.step("value", lambda: AWKWARD)
        tx = ctx.transaction("insert")
        async with tx as session:
            await session.execute(orders.insert().values(note="async"))
            tx.result = AWKWARD
        seen.setdefault("async", []).append((shape(value), shape(tx.result)))
        if ctx.attempt == 1:
            raise RuntimeError("replay them")

    @registry.task("awkward-sync", retry=AGAIN, max_attempts=3)
    def awkward_sync(ctx: SyncTaskContext, payload: None) -> None:
        value = ctx.step("value", lambda: AWKWARD)
        tx = ctx.transaction("insert")
        with tx as session:
            session.execute(orders.insert().values(note="sync"))
            tx.result = AWKWARD
        seen.setdefault("sync", []).append((shape(value), shape(tx.result)))
        if ctx.attempt == 1:
            raise RuntimeError("replay them")

    ids = [await add(pgtask_async_engine, name) for name in ("awkward", "awkward-sync")]
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        for task_id in ids:
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
            assert row["state"] == "succeeded", row["error"]
    for kind in ("async", "sync"):
        first, replay = seen[kind]
        assert first == replay, kind
        assert first[0][0] == ("a", ("float", 2.5))  # jsonb's order, not the dict's


async def test_values_decode_with_the_engines_json_deserializer_on_every_run(
    pgtask_async_engine: AsyncEngine,
) -> None:
    # The first run decoded the stored text with json.loads, replays with the engine's own
    # deserializer: here a float on the first run, a Decimal on the replay.
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    engine = create_async_engine(
        pgtask_async_engine.url, json_deserializer=lambda s: json.loads(s, parse_float=Decimal)
    )
    seen: dict[str, list[tuple[str, str]]] = {}
    registry = Registry()

    @registry.task("decimals", retry=AGAIN, max_attempts=3)
    async def decimals(ctx: TaskContext, payload: None) -> None:
        value = await ctx.step("value", lambda: 1.5)
        tx = ctx.transaction("insert")
        async with tx as session:
            await session.execute(orders.insert().values(note="async"))
            tx.result = 2.5
        seen.setdefault("async", []).append((type(value).__name__, type(tx.result).__name__))
        if ctx.attempt == 1:
            raise RuntimeError("replay them")

    @registry.task("decimals-sync", retry=AGAIN, max_attempts=3)
    def decimals_sync(ctx: SyncTaskContext, payload: None) -> None:
        value = ctx.step("value", lambda: 1.5)
        tx = ctx.transaction("insert")
        with tx as session:
            session.execute(orders.insert().values(note="sync"))
            tx.result = 2.5
        seen.setdefault("sync", []).append((type(value).__name__, type(tx.result).__name__))
        if ctx.attempt == 1:
            raise RuntimeError("replay them")

    ids = [await add(pgtask_async_engine, name) for name in ("decimals", "decimals-sync")]
    try:
        async with running_worker(registry, engine, OPTIONS):
            for task_id in ids:
                row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
                assert row["state"] == "succeeded", row["error"]
    finally:
        await engine.dispose()
    assert seen == {kind: [("Decimal", "Decimal")] * 2 for kind in ("async", "sync")}


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
    assert row["error"]["exception"].endswith("DuplicateStep")  # an InvalidOptionError
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
            # Waiting, not only spawned: a child still running when the clock jumps would
            # lose its lease to the jump and end some other way (CI of cda185c).
            async with pgtask_async_engine.connect() as conn:
                spawned = (await conn.execute(
                    select(func.count())
                    .select_from(Checkpoint)
                    .where(Checkpoint.step == "grandchild")
                )).scalar_one()
                waiting = (await conn.execute(
                    select(func.count()).select_from(Task)
                    .where(Task.name == "slow-child", Task.state == "waiting")
                )).scalar_one()
            return bool(spawned and waiting)

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





async def test_a_suspended_task_resumes_only_on_its_own_handler_version(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    """The versioning rule: checkpoints belong to a handler version; a worker without that
    version leaves the task pending and spends nothing; one with it resumes the replay."""
    calls: Counter[str] = Counter()

    def versions(*registered: int) -> Registry:
        registry = Registry()
        if 1 in registered:

            @registry.task("versioned", version=1, max_attempts=1)
            async def v1(ctx: TaskContext, payload: None) -> str:
                await ctx.step("old-step", lambda: calls.update(["v1 step"]) or "old")
                await ctx.sleep_for("old-nap", 3600)
                return "finished by v1"

        if 2 in registered:

            @registry.task("versioned", version=2, max_attempts=1)
            async def v2(ctx: TaskContext, payload: None) -> str:
                calls["v2"] += 1
                return "v2"

        return registry

    old = await add(pgtask_async_engine, "versioned", version=1)
    async with running_worker(versions(1), pgtask_database_url, OPTIONS):
        await suspended(pgtask_async_engine, old)
    pgtask_clock.advance(3601)

    # Only version 2 deployed: the woken v1 task is due, but this worker never claims it.
    new = await add(pgtask_async_engine, "versioned", version=2)
    async with running_worker(versions(2), pgtask_database_url, OPTIONS):
        assert (await wait_for_state(pgtask_async_engine, new, timeout=PATIENCE))["result"] == "v2"
    row = await task_row(pgtask_async_engine, old)
    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("pending", 1, 0)

    # With version 1 still registered beside 2, the v1 task replays its own checkpoints.
    async with running_worker(versions(1, 2), pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, old, timeout=PATIENCE)
    assert (row["state"], row["result"], row["attempt"]) == ("succeeded", "finished by v1", 2)
    assert calls == Counter({"v1 step": 1, "v2": 1})


async def test_a_finishing_parent_cancels_its_unfinished_children_and_their_waits(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("patient-child")
    async def patient_child(ctx: TaskContext, payload: None) -> None:
        await ctx.spawn("grandchild", "unserved", queue="nobody-serves-this")
        await ctx.wait_for_signal("never", "never", timeout=3600)

    @registry.task("hasty-parent", max_attempts=1)
    async def hasty_parent(ctx: TaskContext, payload: None) -> str:
        child = await ctx.spawn("child", patient_child)
        await ctx.wait_for_signal("go", "go")
        return str(child)

    parent = await add(pgtask_async_engine, "hasty-parent")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await suspended(pgtask_async_engine, parent)

        async def child_waiting() -> bool:
            async with pgtask_async_engine.connect() as conn:
                return bool((await conn.execute(
                    select(func.count()).select_from(Wait).where(Wait.kind == "signal")
                )).scalar_one() == 2)

        await wait_until(child_waiting, PATIENCE, message="parent and child both waiting")
        async with pgtask_async_engine.begin() as conn:
            await emit_signal_async(conn, parent, "go")
        row = await wait_for_state(pgtask_async_engine, parent, timeout=PATIENCE)
    assert row["state"] == "succeeded"
    child = await task_row(pgtask_async_engine, uuid.UUID(row["result"]))
    assert child["state"] == "cancelled"
    assert child["error"] == {
        "type": "cancelled", "reason": "ancestor_finished", "ancestor_id": str(parent)
    }
    async with pgtask_async_engine.connect() as conn:
        grandchild = (await conn.execute(
            select(Task.state, Task.error).where(Task.parent_id == child["id"])
        )).one()
        waits_left = (await conn.execute(select(func.count()).select_from(Wait))).scalar_one()
    assert grandchild.state == "cancelled"
    assert grandchild.error["ancestor_id"] == str(parent)
    assert waits_left == 0  # the child's wait went with it: nothing can fire later


async def test_cancelling_a_waiting_task_cancels_its_wait_so_nothing_fires_later(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, pgtask_clock: DatabaseClock
) -> None:
    registry = Registry()

    @registry.task("waiter", max_attempts=1)
    async def waiter(ctx: TaskContext, payload: None) -> Any:
        return {"got": await ctx.wait_for_signal("approve", "approved", timeout=3600)}

    cancelled = await add(pgtask_async_engine, "waiter")
    witness = await add(pgtask_async_engine, "waiter")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        for task_id in (cancelled, witness):
            await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
        async with pgtask_async_engine.begin() as conn:
            assert await cancel_async(conn, cancelled) == "cancelled"
        pgtask_clock.advance(3601)
        # The witness's timeout firing proves a timeout pass ran after the cancellation.
        row = await wait_for_state(pgtask_async_engine, witness, timeout=PATIENCE)
        assert (row["state"], row["result"]) == ("succeeded", {"got": None})
        async with pgtask_async_engine.begin() as conn:
            await emit_signal_async(conn, cancelled, "approved", "too late")
    row = await task_row(pgtask_async_engine, cancelled)
    assert (row["state"], row["result"], row["attempt"]) == ("cancelled", None, 1)
    assert await checkpoints(pgtask_async_engine, cancelled) == {}


async def test_a_stale_attempt_racing_a_fresh_one_writes_the_business_row_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    inside, release = threading.Event(), threading.Event()
    endings: list[str] = []
    registry = Registry()

    @registry.task("stale-race", max_attempts=5)
    def racer(ctx: SyncTaskContext, payload: None) -> int:
        try:
            with ctx.transaction("insert") as session:
                session.execute(orders.insert().values(note=f"attempt {ctx.attempt}"))
                session.commit()  # ends only the block's savepoint: nothing commits yet
                if ctx.attempt == 1:
                    inside.set()
                    release.wait(PATIENCE)
        except LeaseLost:
            endings.append(f"attempt {ctx.attempt}: lease lost")
            raise
        endings.append(f"attempt {ctx.attempt}: committed")
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "stale-race")
    options = WorkerOptions(lease_duration=5.0, concurrency=2, poll_interval=0.5)
    async with running_worker(registry, pgtask_database_url, options):
        await wait_event(inside)
        # Attempt 1 is still inside its transaction when its lease expires and the task is
        # recovered: attempt 2 starts, runs the block and commits it.
        await expire_and_recover(pgtask_async_engine, task_id)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        assert (row["state"], row["result"]) == ("succeeded", 2)
        release.set()  # the stale attempt now tries to commit its block
        await wait_until(lambda: len(endings) == 2, PATIENCE, message="the stale attempt ended")
    assert endings == ["attempt 2: committed", "attempt 1: lease lost"]
    async with pgtask_async_engine.connect() as conn:
        notes = (await conn.execute(select(orders.c.note))).scalars().all()
    assert notes == ["attempt 2"]


async def test_a_stale_attempt_on_a_repeatable_read_engine_ends_with_lease_lost(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    # At REPEATABLE READ the fence's lock on an attempt row that ended after the block's
    # snapshot is refused (a serialization failure) rather than skipped: the handler used to
    # get that OperationalError, which an ``except Exception`` swallows, not LeaseLost.
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    engine = create_async_engine(pgtask_async_engine.url, isolation_level="REPEATABLE READ")
    inside, release = asyncio.Event(), asyncio.Event()
    endings: list[str] = []
    registry = Registry()

    @registry.task("rr-stale", max_attempts=5)
    async def racer(ctx: TaskContext, payload: None) -> int:
        try:
            async with ctx.transaction("insert") as session:
                await session.execute(orders.insert().values(note=f"attempt {ctx.attempt}"))
                if ctx.attempt == 1:  # its snapshot is taken: now let it go stale
                    inside.set()
                    await asyncio.wait_for(release.wait(), PATIENCE)
        except LeaseLost:
            endings.append(f"attempt {ctx.attempt}: lease lost")
            raise
        except Exception as exc:
            endings.append(f"attempt {ctx.attempt}: {type(exc).__name__}")
            raise
        endings.append(f"attempt {ctx.attempt}: committed")
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "rr-stale")
    options = WorkerOptions(lease_duration=5.0, concurrency=2, poll_interval=0.5)
    try:
        async with running_worker(registry, engine, options):
            await asyncio.wait_for(inside.wait(), PATIENCE)
            await expire_and_recover(pgtask_async_engine, task_id)
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
            assert (row["state"], row["result"]) == ("succeeded", 2)
            release.set()
            await wait_until(lambda: len(endings) == 2, PATIENCE, message="the stale attempt ended")
    finally:
        await engine.dispose()
    assert endings == ["attempt 2: committed", "attempt 1: lease lost"]
    async with pgtask_async_engine.connect() as conn:
        notes = (await conn.execute(select(orders.c.note))).scalars().all()
    assert notes == ["attempt 2"]


async def test_a_fenced_transaction_on_a_repeatable_read_engine_outlives_lease_renewals(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    url = pgtask_async_engine.url
    engine = create_async_engine(url, isolation_level="REPEATABLE READ")
    registry = Registry()

    async def lease_expiry(task_id: uuid.UUID) -> Any:
        return (await task_row(pgtask_async_engine, task_id))["lease_expires_at"]

    @registry.task("rr-order", max_attempts=1)
    async def rr_order(ctx: TaskContext, payload: None) -> int:
        async with ctx.transaction("insert") as session:
            await session.execute(orders.insert().values(note="once"))
            before = await lease_expiry(ctx.task_id)
            # A renewal changes the task row after this transaction's snapshot.

            async def renewed() -> bool:
                return bool(await lease_expiry(ctx.task_id) > before)

            await wait_until(renewed, PATIENCE, message="a lease renewal during the block")
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "rr-order")
    try:
        async with running_worker(
            registry, engine, WorkerOptions(lease_duration=0.9, poll_interval=0.5)
        ):
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    finally:
        await engine.dispose()
    assert (row["state"], row["result"]) == ("succeeded", 1), row["error"]
    async with pgtask_async_engine.connect() as conn:
        assert (await conn.execute(select(orders.c.note))).scalars().all() == ["once"]


async def test_a_replayed_transaction_block_keeps_the_stored_result(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    async with pgtask_async_engine.begin() as conn:
        await conn.run_sync(app_metadata.create_all)
    registry = Registry()

    @registry.task("recompute", retry=AGAIN, max_attempts=2)
    async def recompute(ctx: TaskContext, payload: None) -> Any:
        tx = ctx.transaction("insert")
        async with tx as session:
            tx.result = f"computed by attempt {ctx.attempt}"  # before any database access
            await session.execute(orders.insert().values(note=f"attempt {ctx.attempt}"))
        if ctx.attempt == 1:
            raise RuntimeError("replay the block")
        return tx.result

    task_id = await add(pgtask_async_engine, "recompute")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", "computed by attempt 1")


async def test_a_signal_wait_sees_a_signal_committed_while_it_waited_for_the_task_lock(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    # The database's default isolation is REPEATABLE READ: the worker's wait registration
    # must still take a fresh snapshot after its lock, or it misses the signal committed
    # while it waited and waits for ever.
    database = pgtask_async_engine.url.database
    async with pgtask_async_engine.connect() as conn:
        await conn.execute(text(
            f'ALTER DATABASE "{database}" SET default_transaction_isolation = \'repeatable read\''
        ))
        await conn.commit()
    registry = Registry()

    @registry.task("late-wait", max_attempts=1)
    async def late_wait(ctx: TaskContext, payload: None) -> Any:
        return await ctx.wait_for_signal("approve", "approved")

    task_id = await add(pgtask_async_engine, "late-wait")
    async with pgtask_async_engine.connect() as emitter:
        await emitter.execute(text("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"))
        assert await emit_signal_async(emitter, task_id, "approved", "yes") == "yes"
        async with running_worker(registry, pgtask_database_url, OPTIONS):

            async def registration_blocked() -> bool:
                async with pgtask_async_engine.connect() as conn:
                    return bool((await conn.execute(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%FOR UPDATE OF tasks%'"
                    ))).scalar_one())

            await wait_until(registration_blocked, PATIENCE, message="the wait registration")
            await emitter.commit()
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", "yes")


def test_emit_signal_joins_the_callers_transaction_and_checks_its_input(
    pgtask_engine: Engine,
) -> None:
    with Session(pgtask_engine) as session, session.begin():
        task_id = enqueue(session, "waits-for-a-signal").id
    with Session(pgtask_engine) as session:
        assert emit_signal(session, task_id, "approved", {"by": "ann"}) == {"by": "ann"}
        session.rollback()  # the signal goes with the business transaction
    with Session(pgtask_engine) as session, session.begin():
        assert session.scalar(select(func.count()).select_from(Signal)) == 0
        assert emit_signal(session, task_id, "approved", {"by": "bob"}, occurrence=1) == {
            "by": "bob"
        }
    with Session(pgtask_engine) as session:
        stored = session.execute(select(Signal.name, Signal.occurrence, Signal.value)).all()
        assert [tuple(row) for row in stored] == [("approved", 1, {"by": "bob"})]
        # Bad input is refused before any SQL, and leaves the transaction usable.
        bad: list[Callable[[], object]] = [
            lambda: emit_signal(session, task_id, "no spaces", 1),
            lambda: emit_signal(session, task_id, "ok", {1, 2}),
            lambda: emit_signal(session, task_id, "ok", 1, occurrence=-1),
            lambda: emit_signal(session, "not-a-uuid", "ok", 1),
        ]
        for call in bad:
            with pytest.raises(ValidationError):
                call()
        assert session.scalar(select(func.count()).select_from(Signal)) == 1
        with pytest.raises(TaskNotFound):
            emit_signal(session, uuid.uuid4(), "approved", True)
