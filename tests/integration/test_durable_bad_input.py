"""Durable calls with bad arguments: a typed error, and nothing used up.

A durable call whose own arguments are invalid (a step's function that is not callable, a
negative sleep, a naive wake time, a bad signal name, an unknown spawn option or a payload
that is not JSON, a child id that is not a UUID) raises its typed error before it touches
anything: the step key stays free, so the corrected call under the same key works in the same
run, and a replay raises the same errors and returns the same values as the first run.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    PayloadError,
    Registry,
    RetryPolicy,
    SyncTaskContext,
    TaskContext,
    WorkerOptions,
    emit_signal_async,
)
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, attempt_rows, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
PAST = datetime(2000, 1, 1, tzinfo=timezone.utc)


def _outcome(exc: BaseException) -> str:
    return type(exc).__name__


def _bad_calls(ctx: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Each durable call that takes arguments, with a bad one (the context is untyped here:
    the calls are wrong on purpose). An ``async def`` handler's context returns awaitables."""
    return [
        ("step", lambda: ctx.step("s", 42)),
        ("sleep_for", lambda: ctx.sleep_for("z", -1)),
        ("sleep_until", lambda: ctx.sleep_until("u", datetime(2000, 1, 1))),
        ("wait_for_signal", lambda: ctx.wait_for_signal("w", "bad name!")),
        ("wait_for_signal", lambda: ctx.wait_for_signal("w", "go", timeout=-1)),
        ("spawn", lambda: ctx.spawn("c", "child", {1, 2})),
        ("spawn", lambda: ctx.spawn("c", "child", nope=1)),
        ("spawn", lambda: ctx.spawn("c", "child", priority="high")),
        ("wait_for_result", lambda: ctx.wait_for_result("r", "not a uuid")),
    ]


async def _async_calls(ctx: TaskContext, seen: list[Any]) -> list[Any]:
    """Each durable call that takes arguments: first with a bad one, then corrected, same key;
    what happened goes into ``seen`` as it happens."""
    bad_calls = _bad_calls(ctx)
    for call, make in bad_calls[:8]:
        try:
            await make()
        except (TypeError, ValueError, PayloadError) as exc:
            seen.append([call, _outcome(exc)])
    seen.append(await ctx.step("s", lambda: 1))
    await ctx.sleep_for("z", 0)
    await ctx.sleep_until("u", PAST)
    seen.append(await ctx.wait_for_signal("w", "go"))
    child = await ctx.spawn("c", "child")
    try:
        await bad_calls[8][1]()
    except ValueError as exc:
        seen.append(["wait_for_result", _outcome(exc)])
    result = await ctx.wait_for_result("r", child)
    seen.append(result.state)
    return seen


def _sync_calls(ctx: SyncTaskContext, seen: list[Any]) -> list[Any]:
    """`_async_calls` for a ``def`` handler."""
    bad_calls = _bad_calls(ctx)
    for call, make in bad_calls[:8]:
        try:
            make()
        except (TypeError, ValueError, PayloadError) as exc:
            seen.append([call, _outcome(exc)])
    seen.append(ctx.step("s", lambda: 1))
    ctx.sleep_for("z", timedelta(0))
    ctx.sleep_until("u", PAST)
    seen.append(ctx.wait_for_signal("w", "go"))
    child = ctx.spawn("c", "child")
    try:
        bad_calls[8][1]()
    except ValueError as exc:
        seen.append(["wait_for_result", _outcome(exc)])
    seen.append(ctx.wait_for_result("r", child).state)
    return seen


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_durable_call_with_bad_arguments_leaves_its_step_key_unused(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, kind: str
) -> None:
    runs: list[list[Any]] = []
    registry = Registry()

    parent: list[Any] = []

    async def parent_suspended() -> bool:
        attempts = await attempt_rows(pgtask_async_engine, parent[0])
        return bool(attempts) and attempts[0]["state"] == "suspended"

    @registry.task("child")
    async def child(ctx: TaskContext, payload: None) -> str:
        # Finishing before the parent reaches its wait would let the first run go through
        # without suspending, and then nothing would be replayed.
        await wait_until(parent_suspended, PATIENCE, message="the parent's suspension")
        return "done"

    if kind == "async":

        @registry.task("bad-input", retry=RetryPolicy.never())
        async def bad_input(ctx: TaskContext, payload: None) -> list[Any]:
            runs.append([])
            return await _async_calls(ctx, runs[-1])

    else:

        @registry.task("bad-input", retry=RetryPolicy.never())
        def bad_input_sync(ctx: SyncTaskContext, payload: None) -> list[Any]:
            runs.append([])
            return _sync_calls(ctx, runs[-1])

    task_id = await add(pgtask_async_engine, "bad-input")
    parent.append(task_id)
    async with pgtask_async_engine.begin() as conn:
        await emit_signal_async(conn, task_id, "go", "yes")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert row["state"] == "succeeded", row["error"]
    rejected = [
        ["step", "TypeError"],
        ["sleep_for", "InvalidOptionError"],
        ["sleep_until", "InvalidOptionError"],
        ["wait_for_signal", "InvalidNameError"],
        ["wait_for_signal", "InvalidOptionError"],
        ["spawn", "PayloadError"],
        ["spawn", "InvalidOptionError"],
        ["spawn", "InvalidOptionError"],
    ]
    assert row["result"] == [
        *rejected, 1, "yes", ["wait_for_result", "InvalidOptionError"], "succeeded"
    ]
    # The first run suspended waiting for the child; the replay saw the same errors.
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
        "suspended", "succeeded"
    ]
    assert runs[0] == [*rejected, 1, "yes", ["wait_for_result", "InvalidOptionError"]]
