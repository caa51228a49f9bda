"""tasks: enqueue, read and await tasks from a test; never waits without a deadline.

* `add` enqueues one task in its own committed transaction.
* `read_task` / `read_attempts` read a task's row and its attempt rows through a given
  (synchronous) connection; `task_row` / `attempt_rows` do the same on an `AsyncEngine`.
* `claim_parameters` is what a worker binds to claim (``statements.claim_params``), for a
  claim the test makes itself (as a worker that then dies, say).
* `wait_for_state` polls a task until it reaches one of some states, with a deadline that only
  bounds a hang (`sqlalchemy_pgtask.testing.wait_until`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Final

from sqlalchemy import Connection, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Attempt, RetryPolicy, Task, enqueue_async, statements
from sqlalchemy_pgtask.testing import wait_until

__all__ = [
    "TERMINAL",
    "add",
    "attempt_rows",
    "claim_parameters",
    "read_attempts",
    "read_task",
    "task_row",
    "wait_for_state",
]

TERMINAL: Final = ("succeeded", "failed", "cancelled")

_CLAIM_POLICY: Final = RetryPolicy.fixed(2.0, jitter=False)


async def add(engine: AsyncEngine, name: str, payload: Any = None, **options: Any) -> uuid.UUID:
    """Enqueue one task in its own committed transaction and return its id."""
    async with engine.begin() as conn:
        return (await enqueue_async(conn, name, payload, **options)).id


def read_task(conn: Connection, task_id: uuid.UUID) -> dict[str, Any]:
    """The task's row, every column."""
    return dict(conn.execute(select(Task.__table__).where(Task.id == task_id)).mappings().one())


def read_attempts(conn: Connection, task_id: uuid.UUID) -> list[dict[str, Any]]:
    """The task's attempt rows, every column, in attempt order."""
    rows = conn.execute(
        select(Attempt.__table__).where(Attempt.task_id == task_id).order_by(Attempt.attempt)
    ).mappings()
    return [dict(row) for row in rows]


async def task_row(engine: AsyncEngine, task_id: uuid.UUID) -> dict[str, Any]:
    async with engine.connect() as conn:
        return await conn.run_sync(read_task, task_id)


async def attempt_rows(engine: AsyncEngine, task_id: uuid.UUID) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return await conn.run_sync(read_attempts, task_id)


def claim_parameters(
    *,
    worker_id: uuid.UUID,
    lease: float,
    queue: str = "default",
    identities: Sequence[tuple[str, int]] = (("job", 1),),
    policy: RetryPolicy = _CLAIM_POLICY,
    limit: int = 10,
    max_attempts: int = 5,
) -> statements.ClaimParams:
    """What a worker binds to claim up to ``limit`` tasks of ``queue`` for ``lease`` seconds,
    serving handlers (``identities``: name, version) that share one retry policy."""
    capabilities = [
        statements.Capability(queue, name, version, policy, max_attempts)
        for name, version in identities
    ]
    return statements.claim_params(
        statements.capability_params([queue], capabilities),
        worker_id=worker_id, lease_seconds=lease, limit=limit,
    )


async def wait_for_state(
    engine: AsyncEngine,
    task_id: uuid.UUID,
    states: Iterable[str] = TERMINAL,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Poll until the task is in one of ``states``; return its row.

    :raises TimeoutError: not within ``timeout`` seconds.
    """
    wanted = set(states)
    row: dict[str, Any] = {}

    async def reached() -> bool:
        nonlocal row
        row = await task_row(engine, task_id)
        return row["state"] in wanted

    await wait_until(reached, timeout, message=f"task {task_id} in {sorted(wanted)}")
    return row

