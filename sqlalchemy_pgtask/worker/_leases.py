"""worker._leases: keeps the worker's leases alive, and stops handlers before a lease can lapse.

Two loops with separate jobs:

* **renewal** extends every active lease with one statement every third of the lease (finished
  attempts too: their outcome may still wait for the writer). A lease the database no longer
  shows as this attempt's is lost, and its handler is stopped at once. A row another
  transaction holds locked is skipped, not waited for; it is tried again next round.
* **the watchdog** does not touch the database. It stops any handler whose lease was last
  extended three quarters of a lease ago, whatever the renewal is doing (waiting on a lock,
  reconnecting, or stuck in a statement), and hands its task back: the handler is then over
  before its lease can expire and another worker start the task again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Sequence

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.statements import Lease
from sqlalchemy_pgtask.states import RUNNING
from sqlalchemy_pgtask.worker._attempts import ActiveAttempt, AttemptBook
from sqlalchemy_pgtask.worker._executor import Executor
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient
from sqlalchemy_pgtask.worker._stuck import STUCK_FRACTION

__all__ = ["WATCHDOG_FRACTION", "LeaseKeeper"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: The part of a lease after which a handler whose lease was not extended is stopped.
WATCHDOG_FRACTION = 0.75


class LeaseKeeper:
    def __init__(
        self,
        *,
        connection: HeldConnection,
        book: AttemptBook,
        executor: Executor,
        lease_seconds: float,
    ) -> None:
        self._connection = connection
        self._book = book
        self._executor = executor
        self._lease = lease_seconds
        #: Attempts already stopped (and counted) for a lost lease: their handler may run on
        #: for a while (a synchronous one that ignores its stop request), and each renewal
        #: round finds the lease missing again.
        self._lost: weakref.WeakSet[ActiveAttempt] = weakref.WeakSet()

    async def renew_loop(self) -> None:
        interval = self._lease / 3
        backoff = Backoff(base=min(0.1, interval / 4), cap=interval)
        wait = interval
        while True:
            await asyncio.sleep(wait)
            entries = list(self._book.active.values())
            if not entries:
                wait = interval
                continue
            try:
                await self._renew(entries)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                wait = backoff.next()
                logger.warning("lease renewal failed (%s); retrying in %.2fs", brief(exc), wait)
                continue
            backoff.reset()
            wait = interval

    async def _renew(self, entries: Sequence[ActiveAttempt]) -> None:
        sent = time.monotonic()
        leases = [a.lease for a in entries]
        async with self._connection.use() as conn:
            rows = (
                await conn.execute(statements.RENEW, statements.renew_params(leases, self._lease))
            ).all()
            renewed = {row.id: bool(row.cancel) for row in rows}
            self._book.observer.leases_renewed(len(rows))
            missing = [a for a in entries if a.task_id not in renewed]
            held: set[Lease] = set()
            if missing:
                current = await conn.execute(
                    statements.LEASES, {"ids": [a.task_id for a in missing]}
                )
                held = {
                    Lease(r.id, r.attempt, r.lease_token) for r in current if r.state == RUNNING
                }
        for attempt in entries:
            if attempt.task_id in renewed:
                attempt.lease_sent_at = sent
                if renewed[attempt.task_id]:
                    self._executor.stop(attempt, "cancelled")
            elif attempt.lease in held:
                logger.info(
                    "task %s: its row is locked by another transaction; lease not extended",
                    attempt.task_id,
                )
            elif (
                not attempt.settled
                and attempt not in self._lost  # said and counted once, not every round
                and self._book.active.get(attempt.task_id) is attempt
            ):
                self._lost.add(attempt)
                logger.warning(
                    "task %s attempt %d lost its lease; stopping its handler",
                    attempt.task_id, attempt.lease.attempt,
                )
                self._executor.stop(attempt, "lease_lost")
                self._book.observer.lease_lost("lost")

    async def watchdog(self) -> None:
        limit = self._lease * WATCHDOG_FRACTION
        tick = min(1.0, max(0.02, self._lease / 20))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for attempt in self._book.running():
                if (
                    attempt.ctx.stop_reason is not None
                    and not attempt.definition.is_async
                    and now - attempt.lease_sent_at >= self._lease * STUCK_FRACTION
                ):
                    self._executor.stuck.report(attempt)  # once per attempt
                if attempt.ctx.stop_reason is None and now - attempt.lease_sent_at >= limit:
                    logger.warning(
                        "task %s attempt %d: lease not extended for %.2fs; stopping its "
                        "handler before the lease can expire",
                        attempt.task_id, attempt.lease.attempt, now - attempt.lease_sent_at,
                    )
                    self._executor.stop(attempt, "lease_expiring")
                    self._book.observer.lease_lost("expiring")
