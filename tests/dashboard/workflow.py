"""A real workflow put through every kind of attempt ending, for the timeline's tests.

A real worker runs `BOOK` on the test's own database: its first attempt records a step and
fails; the second sleeps; the third spawns `HOTEL` and waits for it (the child itself waits
for signal ``go``, sent once the parent waits, so the parent is sure to suspend); the fourth
waits for signal ``approval``, which never comes. The worker is stopped there: the parent
stays ``waiting`` and the child ``succeeded``. Step names and the error carry markup, which
every page must show as text.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import create_async_engine

from sqlalchemy_pgtask import Registry, RetryPolicy, TaskContext, WorkerOptions, emit_signal
from sqlalchemy_pgtask.models import Task, Wait
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, wait_for_state
from tests.support.waiting import PATIENCE

BOOK: Final = "trip.book"
HOTEL: Final = "trip.hotel"
#: A step name and an error message are user data: markup that must stay text.
RESERVE: Final = "reserve <i>seat</i>"
BOOM: Final = "<b>no seat</b> left"
OPTIONS: Final = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.2)


class SeatTaken(Exception):
    pass


def registry() -> Registry:
    registry = Registry()

    @registry.task(HOTEL, max_attempts=1)
    async def hotel(ctx: TaskContext, payload: None) -> Any:
        return await ctx.wait_for_signal("await-go", "go")

    @registry.task(BOOK, retry=RetryPolicy.fixed(0.0, jitter=False), max_attempts=2)
    async def book(ctx: TaskContext, payload: None) -> Any:
        await ctx.step(RESERVE, lambda: {"seat": "12A"})
        if ctx.failed_attempts == 0:
            raise SeatTaken(BOOM)
        await ctx.sleep_for("cool-off", 0.2)
        child = await ctx.spawn("spawn-hotel", hotel, None)
        await ctx.wait_for_result("await-hotel", child)
        return await ctx.wait_for_signal("await-approval", "approval", timeout=3600)

    return registry


@dataclass(frozen=True)
class Workflow:
    parent: uuid.UUID
    child: uuid.UUID


def _waits_for(engine: Engine, task_id: uuid.UUID, kind: str) -> bool:
    with engine.connect() as connection:
        return connection.scalar(select(Wait.kind).where(Wait.task_id == task_id)) == kind


async def _run(database_url: str, engine: Engine) -> Workflow:
    async_engine = create_async_engine(database_url)
    try:
        parent = await add(async_engine, BOOK)
        async with running_worker(registry(), async_engine, OPTIONS):
            await wait_until(
                lambda: _waits_for(engine, parent, "child"), PATIENCE, interval=0.05,
                message=f"{parent} to wait for its child",
            )
            with engine.connect() as connection:
                child = connection.scalar(select(Task.id).where(Task.parent_id == parent))
            assert child is not None
            await wait_until(
                lambda: _waits_for(engine, child, "signal"), PATIENCE, interval=0.05,
                message=f"{child} to wait for its signal",
            )
            with engine.begin() as connection:
                emit_signal(connection, child, "go", {"ok": True})
            await wait_for_state(async_engine, child, ["succeeded"], timeout=PATIENCE)
            await wait_until(
                lambda: _waits_for(engine, parent, "signal"), PATIENCE, interval=0.05,
                message=f"{parent} to wait for approval",
            )
        return Workflow(parent=parent, child=child)
    finally:
        await async_engine.dispose()


def run_workflow(database_url: str, engine: Engine) -> Workflow:
    """Put `BOOK` through its attempts (see the module); from a thread of its own, so a
    caller with an event loop of its own (Playwright's) can call it too."""
    found: list[Workflow] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            found.append(asyncio.run(_run(database_url, engine)))
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return found[0]
