"""A definition registered with `Registry.add` runs exactly as one made by `Registry.task`.

`Registry.add` takes a `TaskDefinition` built by hand (or shared from another registry); the
options it accepts are the options `Registry.task` accepts, in every form `task` accepts
them, so a definition that registers is one the worker can claim and run.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, RetryPolicy, TaskContext, WorkerOptions
from sqlalchemy_pgtask.registry import TaskDefinition
from sqlalchemy_pgtask.testing import running_worker
from tests.support.tasks import add, attempt_rows, wait_for_state

OPTIONS = WorkerOptions(
    lease_duration=30.0, heartbeat_interval=0.5, worker_ttl=2.0, shutdown_grace=0.5
)


async def quick(ctx: TaskContext, payload: None) -> str:
    return "done"


@pytest.mark.parametrize(
    "timeout", [timedelta(seconds=30), 30, 2.5], ids=["timedelta", "int", "float"]
)
async def test_a_definition_added_with_any_accepted_timeout_form_is_claimed_and_run(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, timeout: object
) -> None:
    registry = Registry()
    registry.add(TaskDefinition(
        name="by-hand", version=1, queue="default", retry=RetryPolicy.never(),
        max_attempts=1, handler=quick, timeout=timeout,  # type: ignore[arg-type]
    ))
    # A second handler on the same worker: the claim binds every timeout in one array.
    registry.add(TaskDefinition(
        name="other", version=1, queue="default", retry=RetryPolicy.never(),
        max_attempts=1, handler=quick, timeout=1.5,
    ))
    task_id = await add(pgtask_async_engine, "by-hand")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=10.0)
    assert (row["state"], row["result"]) == ("succeeded", "done")
    [attempt] = await attempt_rows(pgtask_async_engine, task_id)
    limit = timedelta(seconds=30) if timeout == 30 or isinstance(timeout, timedelta) else (
        timedelta(seconds=2.5)
    )
    assert attempt["deadline_at"] - attempt["started_at"] == limit


def test_registry_add_stores_the_checked_timeout_in_seconds() -> None:
    registry = Registry()
    definition: TaskDefinition[None, str] = TaskDefinition(
        name="by-hand", version=1, queue="default", retry=RetryPolicy.never(),
        max_attempts=1, handler=quick, timeout=timedelta(minutes=1),  # type: ignore[arg-type]
    )
    registry.add(definition)
    stored = registry.get("default", "by-hand", 1)
    assert stored is not None
    assert stored.timeout == 60.0
    assert type(stored.timeout) is float
