"""Helpers shared by the worker-level integration tests: enqueue, read and wait with a deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Attempt, Task, enqueue_async

TERMINAL: Final = ("succeeded", "failed", "cancelled")


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = ""
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what or condition}")
        await asyncio.sleep(0.02)


async def add(engine: AsyncEngine, name: str, payload: Any = None, **options: Any) -> uuid.UUID:
    """Enqueue one task in its own committed transaction and return its id."""
    async with engine.begin() as conn:
        return (await enqueue_async(conn, name, payload, **options)).id


async def task_row(engine: AsyncEngine, task_id: uuid.UUID) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = (await conn.execute(select(Task.__table__).where(Task.id == task_id))).mappings()
        return dict(row.one())


async def attempt_rows(engine: AsyncEngine, task_id: uuid.UUID) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(Attempt.__table__)
                .where(Attempt.task_id == task_id)
                .order_by(Attempt.attempt)
            )
        ).mappings()
        return [dict(row) for row in rows]


async def wait_for_state(
    engine: AsyncEngine,
    task_id: uuid.UUID,
    states: Iterable[str] = TERMINAL,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Poll until the task is in one of ``states``; return its row."""
    wanted = set(states)
    row: dict[str, Any] = {}

    async def reached() -> bool:
        nonlocal row
        row = await task_row(engine, task_id)
        return row["state"] in wanted

    await wait_until(reached, timeout, f"task {task_id} in {sorted(wanted)}")
    return row
