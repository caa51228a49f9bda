"""worker._listener: the ``LISTEN`` connection; turns notifications into wake-ups, never into work.

Notifications are hints: a wake-up only makes the claim loop ask the database. The listener
reconnects with backoff and, once listening again, wakes the loops at once, because anything
enqueued while it was deaf sent its notification to nobody. The connection comes from the
application's engine (its ``connect_args``, ``creator`` and pool events apply) and is discarded
afterwards rather than returned to the pool with a LISTEN on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask._connection import READY_CHANNEL, WAKE_ALL, listening_connection
from sqlalchemy_pgtask.worker._attempts import NO_OBSERVER, Observer
from sqlalchemy_pgtask.worker._deadlines import Liveness, severing
from sqlalchemy_pgtask.worker._reconnect import Backoff, brief, is_transient

__all__ = ["Listener"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")


class Listener:
    def __init__(
        self,
        engine: AsyncEngine,
        queues: Collection[str],
        *,
        wake: Callable[[], None],
        wake_all: Callable[[], None],
        connect_timeout: float,
        lock: tuple[int, int] | None = None,
        deadline: float = 10.0,
        liveness: Liveness | None = None,
    ) -> None:
        #: A listener that heard nothing for this long makes a round trip, which must be
        #: answered within as long again: a dead path is noticed within twice this.
        self._deadline = deadline
        self._liveness = liveness
        self._engine = engine
        self._lock = lock
        self._queues = frozenset(queues)
        self._wake = wake
        self._wake_all = wake_all
        self._timeout = connect_timeout
        #: Set while the LISTEN is established.
        self.listening = asyncio.Event()
        self.observer: Observer = NO_OBSERVER

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                async with listening_connection(
                    self._engine, READY_CHANNEL, timeout=self._timeout, lock=self._lock
                ) as listener:
                    backoff.reset()
                    self.listening.set()
                    self.observer.connected(self)
                    self._wake_all()  # whatever happened while we were deaf is due now
                    while True:
                        async for payload in listener.payloads(timeout=self._deadline):
                            if payload in self._queues:
                                self._wake()
                            elif payload == WAKE_ALL:
                                self._wake_all()
                        with severing(listener.driver, self._deadline) as fired:
                            try:
                                await listener.ping()
                            except Exception as exc:
                                if fired[0]:
                                    raise TimeoutError(
                                        f"no answer within {self._deadline:g} s"
                                    ) from exc
                                raise
                        if self._liveness is not None:
                            self._liveness.touch()
            except Exception as exc:
                self.listening.clear()
                if not is_transient(exc):
                    raise
                delay = backoff.next()
                logger.warning(
                    "listener disconnected (%s); reconnecting in %.2fs", brief(exc), delay
                )
                await asyncio.sleep(delay)
