"""waiting: wait for a condition or an event with a deadline; never a bare sleep as a signal.

A deadline here only bounds a hang: it is generous (`PATIENCE`), and a test never proves a
guarantee by finishing before it. What a test proves, it proves by what happened and in which
order; where it must tell two wake-ups apart, it makes the other one far slower than
`PATIENCE` (a poll interval of `SLOW_POLL`, say), so finishing at all tells them apart.

* `wait_until` polls a synchronous predicate (the acceptance tests are synchronous; async tests
  use `sqlalchemy_pgtask.testing.wait_until`).
* `wait_event` waits for an `asyncio.Event` or a `threading.Event` (a synchronous handler's).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Final, TypeVar

from sqlalchemy_pgtask.testing import wait_until as wait_until_async

__all__ = ["PATIENCE", "SLOW_POLL", "wait_event", "wait_until"]

_T = TypeVar("_T")

#: How long a test waits for something that is bound to happen: long enough for a loaded
#: machine, so running out of it means a hang, never slowness.
PATIENCE: Final = 60.0

#: A poll interval far longer than `PATIENCE`: what happens within `PATIENCE` was not the poll.
SLOW_POLL: Final = 600.0


def wait_until(
    predicate: Callable[[], _T],
    timeout: float,
    interval: float = 0.05,
    *,
    message: str = "condition",
    describe: Callable[[], str] | None = None,
) -> _T:
    """Poll ``predicate`` until it returns something truthy, and return that; fail at deadline.

    ``describe`` adds context (a worker's log, say) to the failure message.

    :raises AssertionError: nothing truthy within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {message}{extra}")
        time.sleep(interval)  # polling interval, not synchronisation


async def wait_event(event: asyncio.Event | threading.Event, timeout: float = 10.0) -> None:
    """Wait until ``event`` is set.

    :raises TimeoutError: not within ``timeout`` seconds.
    """
    if isinstance(event, asyncio.Event):
        await asyncio.wait_for(event.wait(), timeout)
    else:
        await wait_until_async(event.is_set, timeout, message="a handler's event")
