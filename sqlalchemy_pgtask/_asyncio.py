"""_asyncio: waiting primitives that never swallow a cancellation and never leave a task behind.

``asyncio.wait_for`` before Python 3.12 can swallow a cancellation that arrives just as the
awaited thing finishes (the worker's loops would then keep running after being stopped);
`bounded` and `first` are the two ways this package waits with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

__all__ = ["bounded", "first", "sever", "severing"]

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


def _driver(connection: Any) -> Any:
    """The psycopg connection under a SQLAlchemy ``AsyncConnection`` (or the psycopg one)."""
    sync = getattr(connection, "sync_connection", None)
    if sync is not None or hasattr(connection, "get_raw_connection"):
        return None if sync is None else sync.connection.driver_connection
    return connection


def sever(connection: Any) -> bool:
    """Shut ``connection``'s socket down (both ways); whether there was one to shut.

    Whatever waits on it (a statement, a notification) fails at once with a lost connection;
    the socket itself is closed later, by whoever owns the connection.
    """
    with contextlib.suppress(Exception):
        driver = _driver(connection)
        if driver is None or driver.closed:
            return False
        fd = driver.pgconn.socket
        # A duplicate descriptor: shutdown acts on the socket shared by both, and closing
        # the duplicate leaves the driver's own descriptor for the driver to close.
        with socket.socket(fileno=socket.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        return True
    return False


@contextlib.contextmanager
def severing(connection: Any, seconds: float) -> Iterator[list[bool]]:
    """Sever ``connection`` if the body still runs after ``seconds``.

    Yields a one-item list that is ``[True]`` once the deadline fired.
    """
    fired = [False]

    def expire() -> None:
        fired[0] = True
        sever(connection)

    handle = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        yield fired
    finally:
        handle.cancel()
