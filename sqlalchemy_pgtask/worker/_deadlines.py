"""worker._deadlines: every statement the worker sends is over by a deadline on its own clock.

A server that answers nothing (a pooler, a NAT or a firewall that keeps a dead connection
open; TCP keepalives are then answered by the intermediary) would hold a statement for ever,
and its loop with it. Cancelling the coroutine does not help: psycopg answers a cancellation
by sending a cancel request and waiting for the server (up to 5 + 5 s), over the same dead
path. So a deadline *severs* the connection instead: it shuts its socket down, the driver's
wait ends at once with a lost-connection error (transient: the loop reconnects after its
backoff, on a fresh connection), and no cancel request is ever sent.

A body that runs many statements, each of which may legitimately run up to the server's
``statement_timeout`` (a maintenance pass: a batch, then its tasks one by one), has its
deadline counted from the start of each statement instead (`severing_each`).

`Liveness` remembers the last successful round trip to PostgreSQL, for ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator
from typing import Any, Final, TypeVar

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask._asyncio import sever, severing

__all__ = [
    "DEADLINE_MARGIN", "MIN_QUICK_DEADLINE", "Liveness", "abandon_after", "long_deadline",
    "quick_deadline", "sever", "severing", "severing_each",
]

_T = TypeVar("_T")

#: The shortest deadline of a hot statement: a loaded machine must never miss it.
MIN_QUICK_DEADLINE: Final = 2.0
#: How long after the server's own ``statement_timeout`` a long statement is given up on the
#: client's side: the server cancels it first whenever it can still answer.
DEADLINE_MARGIN: Final = 5.0


def quick_deadline(lease: float, statement_timeout: float) -> float:
    """The deadline of the hot statements (claim, renewal, heartbeat, durable calls, LISTEN):
    a third of the lease (the renewal interval: one that takes longer is already late), at
    least `MIN_QUICK_DEADLINE`, and never shorter than the server's ``statement_timeout``
    allows them to run when that is shorter still."""
    return min(max(lease / 3, MIN_QUICK_DEADLINE), statement_timeout + DEADLINE_MARGIN)


def long_deadline(statement_timeout: float) -> float:
    """The deadline of outcome writes and maintenance passes, which may legitimately run up
    to ``statement_timeout``: given up on only once the server should have cancelled them."""
    return statement_timeout + DEADLINE_MARGIN


@contextlib.contextmanager
def severing_each(connection: AsyncConnection, seconds: float) -> Iterator[list[bool]]:
    """`severing`, with ``seconds`` counted again from the start of each statement the body
    runs on ``connection`` (and from the start of the body)."""
    fired = [False]
    loop = asyncio.get_running_loop()

    def expire() -> None:
        fired[0] = True
        sever(connection)

    handle = [loop.call_later(seconds, expire)]

    def rearm(*_: object) -> None:
        # Run by SQLAlchemy in the event loop's thread (the greenlet of the awaited execute).
        handle[0].cancel()
        handle[0] = loop.call_later(seconds, expire)

    sync = connection.sync_connection
    assert sync is not None
    event.listen(sync, "before_cursor_execute", rearm)
    try:
        yield fired
    finally:
        handle[0].cancel()
        event.remove(sync, "before_cursor_execute", rearm)


class Liveness:
    """When the worker last completed a round trip to PostgreSQL (monotonic seconds)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self.last


async def abandon_after(awaitable: Awaitable[_T], timeout: float) -> _T | None:
    """``awaitable``'s result within ``timeout`` seconds; else None, and it is left behind.

    Unlike `sqlalchemy_pgtask._asyncio.bounded`, a late one is cancelled but never waited for
    (a driver's cancellation can itself wait on a dead network): for the stop, which must
    end in time whatever the network does.
    """
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_forget)
    return None


def _forget(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
