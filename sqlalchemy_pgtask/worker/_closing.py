"""worker._closing: the end of a stop, within a budget whatever the network does.

With a dead path to PostgreSQL every close could wait: a statement in flight (its driver's
cancellation sends a cancel request over the same path and waits for it), a connection reset,
the engine's disposal. So the last part of the stop severs what is still in flight (see
`worker._deadlines`) before it cancels anything, closes every connection at once, and
abandons whatever has not ended by the stop's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask.worker._deadlines import abandon_after
from sqlalchemy_pgtask.worker._reconnect import HeldConnection

__all__ = ["close_within", "stop_in_flight"]

#: The longest one step of the end waits when the budget allows more.
STEP: float = 5.0


async def stop_in_flight(
    connections: Sequence[HeldConnection], tasks: Sequence[asyncio.Task[None]], timeout: float
) -> None:
    """Cancel ``tasks``, severing first what their statements wait on, so that no cancel
    request is sent; wait at most ``timeout`` seconds for them to end."""
    severed = [c for c in connections if c.sever()]
    if severed:  # let each statement fail on its own, before its task is cancelled
        await asyncio.wait(
            [asyncio.ensure_future(c.settled(min(1.0, timeout / 2))) for c in severed]
        )
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.01, timeout))


async def close_within(
    deadline: float,
    *,
    retire: Callable[[float], Awaitable[None]],
    connections: Sequence[HeldConnection],
    durable: Callable[[], Awaitable[None]],
    engine: AsyncEngine | None,
) -> None:
    """Retire the worker's row, close its connections (all at once, without resetting
    them when nobody reuses them: ``engine`` is the worker's own) and dispose of ``engine``,
    abandoning what is not done by monotonic ``deadline``."""

    def left(cap: float = STEP) -> float:
        return max(0.0, min(cap, deadline - time.monotonic()))

    await abandon_after(retire(left(STEP) * 0.5), left())
    reset = engine is None

    async def close_all() -> None:
        await asyncio.gather(
            *(c.close(reset=reset) for c in connections), durable(), return_exceptions=True
        )

    await abandon_after(close_all(), left())
    if engine is not None:
        with contextlib.suppress(Exception):
            await abandon_after(engine.dispose(), left())
