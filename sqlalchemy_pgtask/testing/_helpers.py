"""testing._helpers: run a real worker in a test, and wait for conditions with a deadline.

Usable without pytest: plain ``asyncio`` code (the demo uses them too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from sqlalchemy import (
    ColumnElement,
    SQLColumnExpression,
    and_,
    create_engine,
    exists,
    func,
    or_,
    select,
    tuple_,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import _url
from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask.models import Queue, Schedule, Task, Wait
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import PENDING, RUNNING, WAITING
from sqlalchemy_pgtask.worker import Worker, WorkerOptions

__all__ = ["drain", "running_worker", "wait_until"]


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,
    *,
    interval: float = 0.02,
    message: str = "",
) -> None:
    """Poll ``condition`` (a function, sync or async) until it is true.

    :raises TimeoutError: not true within ``timeout`` seconds; ``message`` says what was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s: {message or condition!r}")
        await asyncio.sleep(interval)  # the poll interval, not a synchronisation


@asynccontextmanager
async def running_worker(
    registry: Registry,
    database: str | AsyncEngine,
    options: WorkerOptions | None = None,
    *,
    startup_timeout: float = 30.0,
) -> AsyncIterator[Worker]:
    """Run a real `Worker` while the ``async with`` body runs; shut it down gracefully after.

    :raises TimeoutError: the worker was not ready within ``startup_timeout`` seconds.
    Whatever stopped the worker during startup (``SchemaNotInstalled``, ``PolicyConflict``,
    ...) is raised as it is.
    """
    worker = Worker(registry, database, options)
    runner = asyncio.create_task(worker.run())
    try:
        ready = asyncio.ensure_future(worker.wait_until_ready())
        await asyncio.wait({ready, runner}, timeout=startup_timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        if runner.done():
            ready.cancel()
            runner.result()  # raises the worker's startup error
            raise RuntimeError("the worker stopped during startup")
        if not ready.done():
            ready.cancel()
            raise TimeoutError(f"the worker was not ready within {startup_timeout} s")
        yield worker
    finally:
        worker.shutdown()
        await runner


async def drain(
    registry: Registry,
    database_url: str,
    options: WorkerOptions | None = None,
    *,
    timeout: float = 30.0,
) -> None:
    """Run a worker until its queues have nothing due and nothing running.

    Due, as a real worker sees it: a pending task whose time has come, a waiting task whose
    wait has timed out, and an unpaused schedule whose next occurrence has come (the worker's
    maintenance passes make those two pending). Tasks scheduled in the future, waits still
    waiting, tasks in a paused queue, and tasks no registered handler can run are left alone.

    :raises TimeoutError: work was still due or running after ``timeout`` seconds.
    """
    engine = create_engine(_url.database_url(database_url))
    identities = [(d.queue, d.name, d.version) for d in registry]
    try:
        async with running_worker(registry, database_url, options) as worker:
            queues = worker.queues

            def runnable(
                queue: SQLColumnExpression[str],
                name: SQLColumnExpression[str],
                version: SQLColumnExpression[int],
            ) -> ColumnElement[bool]:
                return and_(queue.in_(queues), tuple_(queue, name, version).in_(identities))

            # A worker claims nothing from a paused queue, however long it runs.
            paused = exists().where(Queue.name == Task.queue, Queue.paused_at.is_not(None))
            due_tasks = (
                select(func.count())
                .select_from(Task)
                .where(
                    Task.queue.in_(queues),
                    or_(
                        Task.state == RUNNING,
                        runnable(Task.queue, Task.name, Task.version)
                        & or_(
                            (Task.state == PENDING) & (Task.run_at <= NOW) & ~paused,
                            (Task.state == WAITING)
                            & exists().where(Wait.task_id == Task.id, Wait.timeout_at <= NOW),
                        ),
                    ),
                )
                .scalar_subquery()
            )
            due_schedules = (
                select(func.count())
                .select_from(Schedule)
                .where(
                    runnable(Schedule.queue, Schedule.task_name, Schedule.version),
                    Schedule.paused_at.is_(None),
                    Schedule.next_run_at <= NOW,
                )
                .scalar_subquery()
            )

            def left() -> int:
                with engine.connect() as connection:
                    return int(connection.execute(select(due_tasks + due_schedules)).scalar_one())

            def done() -> bool:
                return not left() and not worker.active_count

            await bounded(
                wait_until(done, timeout, message="due or running work to finish"), timeout + 5
            )
    finally:
        engine.dispose()
