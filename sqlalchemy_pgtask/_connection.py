"""_connection: the one seam between the library and a database connection; no SQL of its own.

Channel names and the ``LISTEN`` connection live here, so the worker and the result waiters
agree on them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["READY_CHANNEL", "RESULT_CHANNEL", "WAKE_ALL", "bounded", "listening_connection"]

_T = TypeVar("_T")

#: Hints that work became pending; the payload is the queue name.
READY_CHANNEL: Final = "pgtask_ready"
#: Hints that a task finished; the payload is the task id.
RESULT_CHANNEL: Final = "pgtask_result"
#: A `READY_CHANNEL` payload that wakes every worker whatever its queues (sent when the
#: database clock is moved in tests).
WAKE_ALL: Final = "*"


async def bounded(
    awaitable: Awaitable[_T],
    timeout: float,
    *,
    discard: Callable[[_T], Awaitable[object]] | None = None,
) -> _T:
    """``awaitable``'s result, or `TimeoutError` after ``timeout`` seconds.

    Unlike ``asyncio.wait_for`` before Python 3.12, a cancellation that arrives as the
    awaitable finishes is never swallowed; the result it then leaves behind (a connection) is
    handed to ``discard``.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        with contextlib.suppress(BaseException):
            orphan = await task
            if discard is not None:
                await discard(orphan)
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise TimeoutError(f"gave up after {timeout:g} s")
    return task.result()


async def _close(connection: Any) -> None:
    await connection.close()


@contextlib.asynccontextmanager
async def listening_connection(
    engine: AsyncEngine, *channels: str, timeout: float
) -> AsyncIterator[AsyncIterator[str]]:
    """A connection of ``engine`` that LISTENs on ``channels``; yields the payloads.

    The connection comes from the engine, so its ``connect_args``, ``creator`` and events
    apply; it is invalidated afterwards instead of going back to the pool with a LISTEN on it.
    Connecting and subscribing each give up after ``timeout`` seconds.
    """
    connection = await bounded(engine.connect(), timeout, discard=_close)
    try:
        raw = await connection.get_raw_connection()
        driver: Any = raw.driver_connection  # psycopg.AsyncConnection
        await bounded(driver.set_autocommit(True), timeout)
        for channel in channels:
            await bounded(driver.execute(f"LISTEN {channel}"), timeout)

        async def payloads() -> AsyncIterator[str]:
            async for notification in driver.notifies():
                yield str(notification.payload)

        yield payloads()
    finally:
        with contextlib.suppress(Exception):
            await connection.invalidate()
        with contextlib.suppress(Exception):
            await connection.close()
