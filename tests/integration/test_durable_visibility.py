"""What `get_task`, `get_task_async` and `status.task_detail` show of a durable task: its steps,
its current wait (a signal, a child, or the end of a sleep) with its deadline, its children
and its parent.

Real workers put real tasks into each situation; time moves with the database clock. The
mapped relations never load behind the caller's back: only when asked for.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, insert, select, text
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, selectinload

from sqlalchemy_pgtask import (
    Registry,
    RetryPolicy,
    Task,
    TaskContext,
    WorkerOptions,
    emit_signal_async,
    get_task,
    get_task_async,
)
from sqlalchemy_pgtask.models import Checkpoint
from sqlalchemy_pgtask.models._durable import wake_time
from sqlalchemy_pgtask.status import TaskDetail, TaskRef, WaitInfo, task_detail
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
HOUR = timedelta(hours=1)


def read_task(engine: Engine, task_id: uuid.UUID) -> Task:
    """`get_task` in a session that is closed when it returns: all that is read later was
    loaded by it."""
    with Session(engine) as session:
        task = get_task(session, task_id)
    assert task is not None
    return task


def detail(engine: Engine, task_id: uuid.UUID) -> TaskDetail:
    with engine.connect() as connection:
        connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        found = task_detail(connection, task_id)
    assert found is not None
    return found


def steps_of(task: Task | TaskDetail) -> list[tuple[str, int, str, Any]]:
    return [(s.step, s.occurrence, s.kind, s.value) for s in task.steps]


async def suspended(engine: AsyncEngine, task_id: uuid.UUID) -> None:
    async def done() -> bool:
        rows = await attempt_rows(engine, task_id)
        return bool(rows) and rows[-1]["state"] == "suspended"

    await wait_until(done, PATIENCE, message=f"an attempt of {task_id} suspended")


# -- a signal wait ---------------------------------------------------------------------------


def approval_registry() -> Registry:
    registry = Registry()

    @registry.task("approval", max_attempts=1)
    async def approval(ctx: TaskContext, payload: None) -> Any:
        prepared = await ctx.step("prepare", lambda: {"order": 7})
        answer = await ctx.wait_for_signal(
            "await-approval", "approval", signal_occurrence=2, timeout=3600
        )
        return [prepared, answer]

    return registry


async def test_a_task_waiting_for_a_signal_shows_its_steps_and_its_wait_until_the_timeout(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "approval")
    async with running_worker(approval_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)

        task = read_task(pgtask_engine, task_id)
        assert steps_of(task) == [("prepare", 0, "step", {"order": 7})]
        wait = task.wait
        assert wait is not None
        assert (
            wait.kind, wait.step, wait.occurrence, wait.signal_name, wait.signal_occurrence,
            wait.child_id,
        ) == ("signal", "await-approval", 0, "approval", 2, None)
        # Registered and given its deadline by one statement: an hour of database time.
        assert wait.timeout_at is not None
        assert wait.timeout_at - wait.created_at == HOUR
        assert (task.children, task.parent, task.sleeping_until) == ([], None, None)

        shown = detail(pgtask_engine, task_id)
        assert shown.wait == WaitInfo(
            kind="signal", step="await-approval", occurrence=0, since=wait.created_at,
            deadline=wait.timeout_at, signal_name="approval", signal_occurrence=2,
        )
        assert steps_of(shown) == steps_of(task)
        assert shown.steps[0].version == 1
        assert shown.steps[0].created_at == task.steps[0].created_at
        assert (shown.children, shown.parent, shown.parent_id) == ((), None, None)

        async with pgtask_async_engine.begin() as conn:
            await emit_signal_async(conn, task_id, "approval", {"by": "ann"}, occurrence=2)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded"

    done = read_task(pgtask_engine, task_id)
    assert done.wait is None
    assert steps_of(done) == [
        ("prepare", 0, "step", {"order": 7}),
        ("await-approval", 0, "signal", {"signal": {"by": "ann"}}),
    ]
    assert detail(pgtask_engine, task_id).wait is None


async def test_get_task_async_loads_the_same_relations_for_use_after_the_session(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "approval")
    async with running_worker(approval_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
    async with AsyncSession(pgtask_async_engine) as session:
        task = await get_task_async(session, task_id)
        assert await get_task_async(session, uuid.uuid4()) is None
    assert task is not None
    synchronous = read_task(pgtask_engine, task_id)
    assert steps_of(task) == steps_of(synchronous)
    assert task.wait is not None
    assert synchronous.wait is not None
    assert (task.wait.kind, task.wait.timeout_at) == ("signal", synchronous.wait.timeout_at)
    assert (task.children, task.parent, task.sleeping_until) == ([], None, None)


async def test_get_task_reads_afresh_a_task_already_in_the_session(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "approval")
    async with running_worker(approval_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
        with Session(pgtask_engine) as session:
            first = get_task(session, task_id)
            assert first is not None
            assert (first.state, len(first.steps), first.wait is not None) == (
                "waiting", 1, True,
            )
            async with pgtask_async_engine.begin() as conn:
                await emit_signal_async(conn, task_id, "approval", "yes", occurrence=2)
            await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
            # Same session, same transaction (READ COMMITTED): the object is refreshed.
            again = get_task(session, task_id)
            assert again is first
            assert (again.state, len(again.steps), again.wait) == ("succeeded", 2, None)


# -- children and parents --------------------------------------------------------------------


def order_registry() -> Registry:
    registry = Registry()

    @registry.task("ship")
    async def ship(ctx: TaskContext, payload: dict[str, int]) -> Any:
        label = await ctx.step("label", lambda: f"label-{payload['order']}")
        await ctx.wait_for_signal("await-go", "go")
        return label

    @registry.task("order", max_attempts=1)
    async def order(ctx: TaskContext, payload: None) -> Any:
        first = await ctx.spawn("spawn-first", ship, {"order": 1})
        second = await ctx.spawn("spawn-second", ship, {"order": 2})
        shipped = [await ctx.wait_for_result("await-first", first)]
        shipped.append(await ctx.wait_for_result("await-second", second, timeout=7200))
        return [r.result for r in shipped]

    return registry


async def test_a_parent_waiting_for_a_child_shows_the_wait_its_children_and_their_parent(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    parent_id = await add(pgtask_async_engine, "order")
    async with running_worker(order_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, parent_id, ["waiting"], timeout=PATIENCE)
        parent = read_task(pgtask_engine, parent_id)
        spawned = [uuid.UUID(s.value["task_id"]) for s in parent.steps]
        assert [(s.step, s.kind) for s in parent.steps] == [
            ("spawn-first", "spawn"), ("spawn-second", "spawn"),
        ]
        first, second = spawned
        for child_id in spawned:
            await wait_for_state(pgtask_async_engine, child_id, ["waiting"], timeout=PATIENCE)

        parent = read_task(pgtask_engine, parent_id)
        assert parent.wait is not None
        assert (parent.wait.kind, parent.wait.step, parent.wait.child_id) == (
            "child", "await-first", first,
        )
        assert (parent.wait.timeout_at, parent.wait.signal_name) == (None, None)
        assert [(c.id, c.name, c.state) for c in parent.children] == [
            (first, "ship", "waiting"), (second, "ship", "waiting"),
        ]
        assert parent.parent is None

        child = read_task(pgtask_engine, first)
        assert child.parent is not None
        assert (child.parent.id, child.parent.name, child.parent.state) == (
            parent_id, "order", "waiting",
        )
        assert child.children == []
        assert child.wait is not None
        assert (child.wait.kind, child.wait.signal_name, child.wait.timeout_at) == (
            "signal", "go", None,
        )
        assert steps_of(child) == [("label", 0, "step", "label-1")]

        shown = detail(pgtask_engine, parent_id)
        assert shown.wait is not None
        assert (shown.wait.kind, shown.wait.step, shown.wait.child_id, shown.wait.deadline) == (
            "child", "await-first", first, None,
        )
        assert shown.children == (
            TaskRef(first, "ship", 1, "waiting"), TaskRef(second, "ship", 1, "waiting"),
        )
        shown_child = detail(pgtask_engine, first)
        assert shown_child.parent == TaskRef(parent_id, "order", 1, "waiting")
        assert shown_child.parent_id == parent_id
        assert shown_child.wait is not None
        assert shown_child.wait.kind == "signal"

        # The first child ends: the parent now waits for the second, with a deadline.
        async with pgtask_async_engine.begin() as conn:
            await emit_signal_async(conn, first, "go")
        await wait_for_state(pgtask_async_engine, first, timeout=PATIENCE)

        async def waits_for_second() -> bool:
            wait = detail(pgtask_engine, parent_id).wait
            return wait is not None and wait.child_id == second

        await wait_until(waits_for_second, PATIENCE, message="the parent to wait for child 2")
        shown = detail(pgtask_engine, parent_id)
        assert shown.wait is not None
        assert shown.wait.deadline is not None
        assert shown.wait.deadline - shown.wait.since == 2 * HOUR
        assert [(c.id, c.state) for c in shown.children] == [
            (first, "succeeded"), (second, "waiting"),
        ]
        assert [(s.step, s.kind) for s in shown.steps][2:] == [("await-first", "result")]
        assert shown.steps[2].value == {"state": "succeeded", "result": "label-1", "error": None}


# -- a durable sleep -------------------------------------------------------------------------


async def test_a_sleeping_task_shows_its_wake_time_as_its_wait(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    pgtask_clock: DatabaseClock,
) -> None:
    registry = Registry()

    @registry.task("sleeper", max_attempts=1)
    async def sleeper(ctx: TaskContext, payload: None) -> str:
        await ctx.step("prepare", lambda: "ready")
        await ctx.sleep_for("nap", 3600)
        return "woke"

    task_id = await add(pgtask_async_engine, "sleeper")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await suspended(pgtask_async_engine, task_id)
        task = read_task(pgtask_engine, task_id)
        assert task.state == "pending"
        assert task.wait is None  # a sleep is not a wait row: the task is pending
        assert [(s.step, s.kind) for s in task.steps] == [("prepare", "step"), ("nap", "sleep")]
        nap = task.steps[-1]
        assert nap.wake_at == task.run_at
        assert task.steps[0].wake_at is None
        # Computed by the statement that stored it: an hour of database time.
        assert task.run_at - nap.created_at == HOUR
        assert task.sleeping_until == task.run_at

        async with AsyncSession(pgtask_async_engine) as session:
            found = await get_task_async(session, task_id)
            assert found is not None
            assert found.sleeping_until == task.run_at

        shown = detail(pgtask_engine, task_id)
        assert shown.wait == WaitInfo(
            kind="sleep", step="nap", occurrence=0, since=nap.created_at, deadline=task.run_at,
        )
        assert shown.steps[-1].value == nap.value

        pgtask_clock.advance(3600)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["result"]) == ("succeeded", "woke")
    done = read_task(pgtask_engine, task_id)
    assert done.sleeping_until is None
    assert detail(pgtask_engine, task_id).wait is None


async def test_a_retried_task_whose_latest_step_is_a_sleep_is_not_asleep(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    pgtask_clock: DatabaseClock,
) -> None:
    registry = Registry()

    @registry.task("nap-then-fail", max_attempts=2, retry=RetryPolicy.fixed(3600, jitter=False))
    async def nap_then_fail(ctx: TaskContext, payload: None) -> None:
        await ctx.sleep_for("nap", 60)
        raise RuntimeError("after the nap")

    task_id = await add(pgtask_async_engine, "nap-then-fail")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await suspended(pgtask_async_engine, task_id)
        assert read_task(pgtask_engine, task_id).sleeping_until is not None
        pgtask_clock.advance(60)

        async def retry_scheduled() -> bool:
            return bool((await task_row(pgtask_async_engine, task_id))["failed_attempts"] == 1)

        await wait_until(retry_scheduled, PATIENCE, message="the failed attempt")
    task = read_task(pgtask_engine, task_id)
    # Pending for its retry, its latest checkpoint still the sleep: but run_at moved.
    assert (task.state, task.steps[-1].kind) == ("pending", "sleep")
    assert task.run_at != task.steps[-1].wake_at
    assert task.sleeping_until is None
    assert detail(pgtask_engine, task_id).wait is None


@pytest.mark.parametrize(
    "zone", ["UTC", "Asia/Kolkata", "America/St_Johns", "Europe/Amsterdam", "Pacific/Chatham"]
)
def test_a_stored_wake_time_reads_back_in_every_session_time_zone(
    pgtask_engine: Engine, zone: str
) -> None:
    # PostgreSQL writes the JSON in the writer's time zone, trimming the fraction's zeros
    # (and, for old local mean times, with an offset in seconds).
    instants = [
        "2024-05-01 12:00:00+00", "2024-05-01 12:00:00.5+00", "2024-05-01 12:00:00.12+00",
        "2024-05-01 12:00:00.123456+00", "1850-01-01 00:00:00.25+00",
    ]
    with pgtask_engine.connect() as connection:
        connection.execute(text("SELECT set_config('TimeZone', :zone, true)"), {"zone": zone})
        for instant in instants:
            stored, expected = connection.execute(
                text(
                    "SELECT jsonb_build_object('wake_at', CAST(:at AS timestamptz)),"
                    " CAST(:at AS timestamptz)"
                ),
                {"at": instant},
            ).one()
            assert wake_time("sleep", stored) == expected, stored
    assert wake_time("step", {"wake_at": "2024-05-01T12:00:00+00:00"}) is None
    assert wake_time("sleep", {"wake_at": "2024-05-01T12:00:00"}) is None  # no offset
    assert wake_time("sleep", {"wake_at": "infinity"}) is None
    assert wake_time("sleep", "2024-05-01T12:00:00+00:00") is None


# -- never a hidden query ----------------------------------------------------------------------


@pytest.fixture
def statements_run(pgtask_engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Connection, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(pgtask_engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(pgtask_engine, "before_cursor_execute", record)


async def test_relations_load_only_when_asked_for_never_behind_the_callers_back(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, statements_run: list[str]
) -> None:
    parent_id = await add(pgtask_async_engine, "order")
    with pgtask_engine.begin() as connection:
        connection.execute(
            insert(Task).values(
                id=uuid.uuid4(), queue="default", name="ship", payload=None, parent_id=parent_id
            )
        )
        connection.execute(
            insert(Checkpoint).values(
                task_id=parent_id, version=1, step="s", occurrence=0, kind="step", value=1
            )
        )
    with Session(pgtask_engine) as session:
        statements_run.clear()
        parent, child = session.scalars(select(Task).order_by(Task.created_at)).all()
        assert len(statements_run) == 1  # a listing pays nothing for the relations
        for relation in ("steps", "wait", "children"):
            with pytest.raises(InvalidRequestError, match="raise_on_sql"):
                getattr(parent, relation)
        with pytest.raises(InvalidRequestError, match="raise_on_sql"):
            _ = child.steps
        # What needs no SQL is answered: no parent id, or the parent already in the session.
        assert parent.parent is None
        assert child.parent is parent
        assert len(statements_run) == 1
        # Loader options load them in bulk, one statement per relation.
        loaded = session.scalars(
            select(Task)
            .options(selectinload(Task.steps), selectinload(Task.children))
            .execution_options(populate_existing=True)
        ).all()
        assert len(statements_run) == 4
        by_id = {t.id: t for t in loaded}
        assert [s.value for s in by_id[parent_id].steps] == [1]
        assert [c.name for c in by_id[parent_id].children] == ["ship"]
        statements_run.clear()
        found = get_task(session, parent_id)
        assert found is not None
        # The task with its wait and parent joined, then its steps, then its children.
        assert len(statements_run) == 3
    async with AsyncSession(pgtask_async_engine) as async_session:
        task = await async_session.get(Task, parent_id)
        assert task is not None
        # A clear error rather than a lazy load (which fails inside asyncio anyway).
        with pytest.raises(InvalidRequestError, match="raise_on_sql"):
            _ = task.children


async def test_get_task_of_an_unknown_task_is_none_and_loads_nothing_else(
    pgtask_engine: Engine, statements_run: list[str]
) -> None:
    with Session(pgtask_engine) as session:
        statements_run.clear()
        assert get_task(session, uuid.uuid4()) is None
        # The collections' SELECTs run only for a task that was found.
        assert len([s for s in statements_run if s.lstrip().upper().startswith("SELECT")]) == 1

