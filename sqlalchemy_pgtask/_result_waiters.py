"""_result_waiters: one ``LISTEN pgtask_result`` per engine, shared by every result waiter.

A waiter per connection would take one of the engine's pooled connections for as long as it
waits: a web application whose requests wait for tasks would run out of its pool (5 + 10 by
default) at the sixteenth concurrent waiter. Here the waiters of one engine (per event loop,
for an `AsyncEngine`, whose connections belong to one loop) share one listening connection,
opened by the first waiter and closed when the last one leaves (a synchronous engine's within
`_SYNC_READ`, unless a waiter comes first and keeps it). A waiter is registered before
the listener is known to be listening and reads the task only then, so a task that finishes
after the read always wakes it.

Notifications stay hints, as before: a waiter re-reads at least every poll interval. When the
shared connection breaks, the listener reconnects (waiters go on polling meanwhile) and then
wakes every waiter once, since what finished while it was deaf notified nobody. Only a first
connection that fails is an error, raised in every waiter that waits for it; a waiter whose
deadline comes first raises its own timeout instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Final

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask._connection import (
    RESULT_CHANNEL,
    listening_connection,
    listening_connection_sync,
)
from sqlalchemy_pgtask._failures import Backoff, brief

__all__ = ["subscribed", "subscribed_sync"]

logger = logging.getLogger("sqlalchemy_pgtask.results")

#: How long the synchronous listener blocks in one read: the latest it notices that its last
#: waiter left.
_SYNC_READ: Final = 0.5


def _lost(exc: BaseException, delay: float) -> None:
    logger.warning(
        "the result waiters' listening connection failed (%s); reconnecting in %.2fs",
        brief(exc), delay,
    )


class _Waiters:
    """Waiters by task id (the text the notifications carry); no I/O."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[asyncio.Event | threading.Event]] = {}
        self.count = 0

    def add(self, task_id: str, event: asyncio.Event | threading.Event) -> None:
        self.by_id.setdefault(task_id, []).append(event)
        self.count += 1

    def remove(self, task_id: str, event: asyncio.Event | threading.Event) -> None:
        events = self.by_id[task_id]
        events.remove(event)
        if not events:
            del self.by_id[task_id]
        self.count -= 1

    def deliver(self, payload: str) -> None:
        for task_id in payload.split(","):
            for event in self.by_id.get(task_id, ()):
                event.set()

    def wake_all(self) -> None:
        for events in self.by_id.values():
            for event in events:
                event.set()


def _own(failure: BaseException) -> BaseException:
    """``failure`` as one waiter raises it: a copy, or each waiter that raised the one object
    (in its own thread or task) would splice its frames into the others' traceback."""
    try:
        own = copy.copy(failure)
    except Exception:  # an exception that cannot be rebuilt from its arguments
        return failure
    own.__cause__, own.__context__ = failure.__cause__, failure.__context__
    own.__suppress_context__ = failure.__suppress_context__
    return own.with_traceback(failure.__traceback__)


# -- async ------------------------------------------------------------------------------------


class _AsyncListener:
    def __init__(
        self, engine: AsyncEngine, timeout: float, registry: dict[AsyncEngine, _AsyncListener]
    ) -> None:
        self._engine = engine
        self._timeout = timeout
        self._registry = registry
        self.waiters = _Waiters()
        #: Set once listening for the first time, or once that failed (then `failure` is set).
        self.started = asyncio.Event()
        self.failure: BaseException | None = None
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name="pgtask-result-listener"
        )

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                async with listening_connection(
                    self._engine, RESULT_CHANNEL, timeout=self._timeout
                ) as listener:
                    backoff.reset()
                    self.started.set()
                    self.waiters.wake_all()  # deaf until now: anything may have finished
                    async for payload in listener.payloads():
                        self.waiters.deliver(payload)
            except Exception as exc:
                if not self.started.is_set():
                    self._fail(exc)
                    return
                delay = backoff.next()
                _lost(exc, delay)
                await asyncio.sleep(delay)

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        # Later waiters start a listener of their own instead of sharing this failure.
        if self._registry.get(self._engine) is self:
            del self._registry[self._engine]
        self.started.set()


#: Per event loop (an engine's async connections belong to the loop that opened them).
_ASYNC: Final[
    weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[AsyncEngine, _AsyncListener]]
] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def subscribed(
    engine: AsyncEngine, task_id: str, *, timeout: float, deadline: float | None,
    late: Callable[[], BaseException],
) -> AsyncIterator[asyncio.Event]:
    """An event set when ``task_id`` may have finished, once ``engine``'s shared listener
    listens (connecting gives up after ``timeout`` seconds; its error is raised here). If it
    does not listen by ``deadline`` (`time.monotonic`), ``late()`` is raised instead."""
    registry = _ASYNC.setdefault(asyncio.get_running_loop(), {})
    listener = registry.get(engine)
    if listener is None:
        listener = registry[engine] = _AsyncListener(engine, timeout, registry)
    event = asyncio.Event()
    listener.waiters.add(task_id, event)
    try:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(listener.started.wait(), remaining)
        except asyncio.TimeoutError:
            raise late() from None
        if listener.failure is not None:
            raise _own(listener.failure)
        yield event
    finally:
        listener.waiters.remove(task_id, event)
        if not listener.waiters.count:
            if registry.get(engine) is listener:
                del registry[engine]
            listener.task.cancel()
            # Until its connection is closed; a cancellation of this waiter still ends it.
            await asyncio.wait({listener.task})


# -- sync ---------------------------------------------------------------------------------


class _SyncListener:
    """The same for a synchronous engine: the listening connection is read in a thread."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.waiters = _Waiters()
        self.started = threading.Event()
        self.failure: BaseException | None = None
        #: Set (under `_SYNC_LOCK`) when the last waiter left, cleared by a waiter that comes
        #: before the thread saw it: the listener and its connection serve that one too.
        self.stopped = False
        threading.Thread(target=self._run, name="pgtask-result-listener", daemon=True).start()

    def _retiring(self) -> bool:
        """Whether the last waiter left; if so the listener is no longer registered, so the
        next waiter starts another (decided under the lock waiters register under)."""
        with _SYNC_LOCK:
            if self.stopped and _SYNC.get(self._engine) is self:
                del _SYNC[self._engine]
            return self.stopped

    def _run(self) -> None:
        backoff = Backoff()
        while not self._retiring():
            try:
                with listening_connection_sync(self._engine, RESULT_CHANNEL) as listener:
                    backoff.reset()
                    self.started.set()
                    with _SYNC_LOCK:
                        self.waiters.wake_all()
                    while not self._retiring():
                        for payload in listener.payloads(timeout=_SYNC_READ):
                            with _SYNC_LOCK:
                                self.waiters.deliver(payload)
            except Exception as exc:
                if not self.started.is_set():
                    with _SYNC_LOCK:
                        self.failure = exc
                        if _SYNC.get(self._engine) is self:
                            del _SYNC[self._engine]
                    self.started.set()
                    return
                delay = backoff.next()
                _lost(exc, delay)
                time.sleep(delay)  # a backoff before reconnecting; waiters poll meanwhile


#: Guards `_SYNC` and every synchronous listener's waiters.
_SYNC_LOCK = threading.Lock()
_SYNC: Final[dict[Engine, _SyncListener]] = {}


def _forget_after_fork() -> None:
    # A forked child has none of its parent's listener threads, and must not read their
    # connections: its first waiter starts afresh (the lock may have been held at the fork).
    global _SYNC_LOCK
    _SYNC_LOCK = threading.Lock()
    _SYNC.clear()
    _ASYNC.clear()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def subscribed_sync(
    engine: Engine, task_id: str, *, deadline: float | None, late: Callable[[], BaseException]
) -> Iterator[threading.Event]:
    """`subscribed` for a synchronous engine."""
    event = threading.Event()
    with _SYNC_LOCK:
        listener = _SYNC.get(engine)
        if listener is None:
            listener = _SYNC[engine] = _SyncListener(engine)
        listener.stopped = False
        listener.waiters.add(task_id, event)
    try:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not listener.started.wait(remaining):
            raise late()
        if listener.failure is not None:
            raise _own(listener.failure)
        yield event
    finally:
        with _SYNC_LOCK:
            listener.waiters.remove(task_id, event)
            if not listener.waiters.count:
                # The thread closes the connection within `_SYNC_READ`, unless a waiter
                # comes first.
                listener.stopped = True
