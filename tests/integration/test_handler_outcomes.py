"""Whatever a handler returns or raises, its attempt's outcome is written at once.

A return value or exception the worker cannot even turn into a document (a collection whose
iteration raises, an exception class whose name cannot be encoded) must still end the
attempt with a recorded failure, never leave the task running until its lease expires.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    Registry,
    Retry,
    RetryPolicy,
    SyncTaskContext,
    TaskContext,
    WorkerOptions,
)
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import add, attempt_rows, wait_for_state

#: Long enough that a lease expiry cannot pass for a written outcome within the wait.
OPTIONS = WorkerOptions(
    lease_duration=30.0, heartbeat_interval=0.5, worker_ttl=2.0, shutdown_grace=0.5
)


class ExplodingList(list[int]):
    """A list whose iteration raises (a lazy collection that can no longer load)."""

    def __iter__(self) -> Any:
        raise RuntimeError("the collection can no longer load")


class Oddly(Exception):
    """An exception class whose module name holds an unpaired surrogate."""


Oddly.__module__ = "generated\udc80module"


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_result_that_raises_while_serialised_is_recorded_as_rejected_at_once(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, sync: bool
) -> None:
    registry = Registry()
    policy = RetryPolicy.fixed(0.0, jitter=False)
    if sync:

        @registry.task("lazy", retry=policy, max_attempts=3)
        def lazy_sync(ctx: SyncTaskContext, payload: None) -> object:
            return {"items": ExplodingList([1, 2])}

    else:

        @registry.task("lazy", retry=policy, max_attempts=3)
        async def lazy(ctx: TaskContext, payload: None) -> object:
            return {"items": ExplodingList([1, 2])}

    task_id = await add(pgtask_async_engine, "lazy")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=10.0)
    # Terminal at once: serialising the same value again would fail the same way.
    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("failed", 1, 1)
    assert row["error"]["type"] == "result_rejected"
    assert "RuntimeError" in row["error"]["reason"]
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    assert attempt["error"]["type"] == "result_rejected"


async def test_an_exception_whose_class_name_cannot_be_encoded_is_recorded_and_retried(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()

    @registry.task("odd", retry=RetryPolicy.fixed(0.0, jitter=False), max_attempts=2)
    async def odd(ctx: TaskContext, payload: None) -> None:
        raise Oddly("the message is fine")

    task_id = await add(pgtask_async_engine, "odd")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=10.0)
    # Retried by policy like any handler error, then failed for good.
    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("failed", 2, 2)
    assert row["error"]["type"] == "handler_error"
    assert row["error"]["exception"].endswith(".Oddly")
    assert row["error"]["message"] == "the message is fine"
    attempts = await attempt_rows(pgtask_async_engine, task_id)
    assert [a["error"]["type"] for a in attempts] == ["handler_error", "handler_error"]


class RateLimited(Retry):
    """A Retry subclass that never calls ``Retry.__init__`` (so it has no ``delay``)."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after


class Backoff(Retry):
    """A Retry subclass that sets its own delay, as a timedelta."""

    def __init__(self) -> None:
        super().__init__("back off")
        self.delay = timedelta(seconds=0)  # type: ignore[assignment]


@pytest.mark.parametrize("retry", [RateLimited, Backoff], ids=["no-init", "timedelta-delay"])
async def test_a_retry_subclass_with_its_own_idea_of_delay_is_retried(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, retry: type[Exception]
) -> None:
    registry = Registry()

    @registry.task("limited", retry=RetryPolicy.fixed(0.0, jitter=False), max_attempts=3)
    async def limited(ctx: TaskContext, payload: None) -> str:
        if ctx.attempt == 1:
            raise retry(5.0) if retry is RateLimited else retry()
        return "done"

    task_id = await add(pgtask_async_engine, "limited")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=10.0)
    assert (row["state"], row["result"], row["attempt"]) == ("succeeded", "done", 2)
    first, _ = await attempt_rows(pgtask_async_engine, task_id)
    assert first["error"]["type"] == "retry"
