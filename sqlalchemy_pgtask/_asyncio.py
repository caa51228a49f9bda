"""_asyncio: waiting primitives that never swallow a cancellation and never leave a task behind.

``asyncio.wait_for`` before Python 3.12 can swallow a cancellation that arrives just as the
awaited thing finishes (the worker's loops would then keep running after being stopped);
`bounded` and `first` are the two ways this package waits with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["bounded", "first"]

_T = TypeVar("_T")


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


async def first(*waits: Awaitable[Any], timeout: float | None = None) -> None:
    """Wait until the first of ``waits`` finishes or ``timeout`` passes; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # the caller decides what an ended wait means
            else:
                task.cancel()
