"""worker._stopped: one `Worker.run` in progress, and what `Worker.shutdown` returns.

`shutdown` stays a plain call (signal handlers and other threads have no event loop to await
on), so what it returns must be fine to drop: an awaitable object, not a coroutine, which
Python would report as never awaited. Awaited, it waits until `run` has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from typing import Any

__all__ = ["Stopped"]


class Stopped:
    """Done once `Worker.run` has returned; at once for a worker whose run never started.

    Awaitable from any event loop, as often as wanted; cancelling one wait leaves the worker's
    stop and the other waits alone.
    """

    def __init__(self) -> None:
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        #: The event loop `run` runs on, and its task; None before it started.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Task[Any] | None = None

    def start(self) -> None:
        """`run` starts, in the running task."""
        self.loop = asyncio.get_running_loop()
        self._runner = asyncio.current_task()

    def cancelling(self) -> bool:
        """Whether `run`'s task is being cancelled (asyncio.run's end cancels every task).

        Python 3.10 cannot tell (no ``Task.cancelling``): there it says no.
        """
        cancelling = getattr(self._runner, "cancelling", None)
        return cancelling is not None and bool(cancelling())

    def set(self) -> None:
        """`run` has returned (or raised)."""
        if not self._done.done():
            self._done.set_result(None)

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        if self.loop is not None:
            await asyncio.shield(asyncio.wrap_future(self._done))
