"""worker._producer: the claim loop; claims for the free slots and hands rows to the executor.

One statement claims across all the worker's queues; the claim commits before any handler
runs. While handlers finish fast it claims ahead of the free slots (never for governed
queues, whose claims spend rate-limit tokens), and the extra rows wait for a slot in
`_prefetch`: handed back through the outcome writer if they wait too long, and when the
worker stops. A row is out of the wait before its hand-back is sent, so it never starts
after one.
When fewer tasks were due than asked for, the database says when the next one falls due
(already, if a due row was locked by someone else: then it tries again shortly), and the loop
sleeps until then, a notification, or the poll interval.

Queues with a rate limit or a starvation timeout are governed: the plain claim never serves
them, and a longer claim that does is used while any of the worker's queues is governed. The
loop looks up which are every few seconds (`GOVERNED_REFRESH`), so a new limit holds at once
and its queue is served again within that time.

If the connection breaks during a claim, the claim may have committed: its rows are running
under this worker's id and nobody knows. The next pass reads the worker's leases back and
hands the unknown ones back (a release, which spends no attempt), instead of leaving them to
expire as a failed attempt that never ran.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import first
from sqlalchemy_pgtask._driver_sql import execute_async
from sqlalchemy_pgtask.statements import CapabilityParams, Lease
from sqlalchemy_pgtask.worker._attempts import AttemptBook
from sqlalchemy_pgtask.worker._executor import Executor
from sqlalchemy_pgtask.worker._prefetch import Prefetch, Waiting
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient

__all__ = ["Producer"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: Seconds between looks at which of the worker's queues are governed.
GOVERNED_REFRESH = 2.0
#: A row claimed ahead starts only within this part of the lease after its claim was sent:
#: its first renewal (within a third of the lease) then comes before the watchdog's limit.
START_BEFORE = 0.4


class Producer:
    def __init__(
        self,
        *,
        connection: HeldConnection,
        book: AttemptBook,
        executor: Executor,
        worker_id: uuid.UUID,
        capabilities: CapabilityParams,
        lease_seconds: float,
        poll_interval: float,
        prefetch: int,
        wake: asyncio.Event,
        stopping: asyncio.Event,
    ) -> None:
        self._connection = connection
        self._book = book
        self._executor = executor
        self._worker_id = worker_id
        self._capabilities = capabilities
        self._lease = lease_seconds
        self._poll = poll_interval
        self._wake = wake
        self._stopping = stopping
        #: Until this monotonic time, a claim that failed may still commit (its backend may
        #: not have seen the connection break yet): each pass reads the leases back till then.
        self._unknown_until = 0.0
        self._governed = False
        self._governed_checked = float("-inf")
        self._prefetch = Prefetch(prefetch, lease_seconds)
        #: The last claim failed (``/readyz`` says so until one succeeds).
        self.failing = False
        #: The claim returns rows by priority; with several queues, earlier queues go first.
        self._rank = {queue: i for i, queue in enumerate(capabilities["queues"])}
        book.on_settle = self._prefetch.finished

    async def run(self) -> None:
        backoff = Backoff(cap=5.0)
        due_backoff = Backoff(base=0.001, cap=1.0)
        while not self._stopping.is_set():
            self._wake.clear()
            free = self._start_waiting()
            ahead = not (self._governed or self._book.writer_behind())
            limit = self._prefetch.claim_size(free, time.monotonic(), ahead=ahead)
            if limit <= 0:
                # A freed slot, a notification or a stop sets the event.
                until_stale = self._prefetch.until_stale(time.monotonic())
                if until_stale is None:
                    await self._wake.wait()
                else:
                    await first(self._wake.wait(), timeout=until_stale)
                continue
            try:
                full, seconds = await self._pass(limit, free)
                backoff.reset()
                self.failing = False
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.failing = True
                delay = backoff.next()
                logger.warning("claim failed (%s); retrying in %.2fs", brief(exc), delay)
                await first(self._stopping.wait(), timeout=delay)
                continue
            if full:
                continue  # as many as asked for: claim again once slots free up
            if seconds is None:
                timeout = self._poll
            elif seconds <= 0:
                # Due but not claimed: its row was locked by another claimer (or anyone).
                timeout = due_backoff.next()
            else:
                due_backoff.reset()
                timeout = max(0.001, min(self._poll, seconds))
            until_stale = self._prefetch.until_stale(time.monotonic())
            if until_stale is not None:
                timeout = min(timeout, until_stale)
            logger.debug("idle: next claim within %.3fs", timeout)
            await first(self._wake.wait(), timeout=timeout)
        self.hand_back_waiting()  # rows that never started go back at once, for others

    def _start_waiting(self) -> int:
        """Start waiting rows in the free slots, hand back stale ones; return the slots
        still free."""
        now = time.monotonic()
        self._hand_back(self._prefetch.take_stale(now), "waited too long for a slot")
        free = self._book.free_slots()
        if free <= 0 or not len(self._prefetch):
            return free
        too_old = []
        for waiting in self._prefetch.take(free):
            if now - waiting.sent >= self._lease * START_BEFORE:
                # Its unrenewed lease has run too far for the first renewal to come before
                # the watchdog's limit (the claim loop was held up): hand it back instead.
                too_old.append(waiting)
            else:
                self._executor.start(waiting.row, waiting.sent, waited=now - waiting.arrived)
        self._hand_back(too_old, "its lease ran too far while it waited")
        return self._book.free_slots()

    def hand_back_waiting(self) -> None:
        """Hand back every row waiting for a slot (the worker stops): through the outcome
        writer, which the stop waits for."""
        self._hand_back(self._prefetch.take(len(self._prefetch)), "the worker stops")

    def _hand_back(self, rows: list[Waiting], why: str) -> None:
        for waiting in rows:
            self._executor.hand_back(waiting.row, waiting.sent)
        if rows:
            logger.info("handing back %d claimed task(s) that never started: %s", len(rows), why)

    async def _pass(self, limit: int, free: int) -> tuple[bool, float | None]:
        """Claim up to ``limit`` (``free`` of them for free slots): whether all were filled,
        else seconds until the next is due (None: nothing is scheduled)."""
        async with self._connection.use() as conn:
            if self._unknown_until:
                await self._hand_back_unknown(conn)
            if time.monotonic() - self._governed_checked >= GOVERNED_REFRESH:
                governed = (
                    await conn.execute(
                        statements.GOVERNED_QUEUES, {"queues": self._capabilities["queues"]}
                    )
                ).first()
                self._governed = governed is not None
                self._governed_checked = time.monotonic()
                if self._governed:  # it just became so: nothing ahead of the free slots
                    limit = free
                    if limit <= 0:
                        return True, None
            claim = statements.CLAIM_GOVERNED if self._governed else statements.CLAIM
            sent = time.monotonic()
            try:
                rows = (
                    await execute_async(
                        conn,
                        claim,
                        statements.claim_params(
                            self._capabilities, worker_id=self._worker_id,
                            lease_seconds=self._lease, limit=limit,
                        ),
                    )
                ).all()
            except BaseException:
                # Read back for a lease: past that, a late commit's tasks would be expired
                # and recovered anyway.
                self._unknown_until = time.monotonic() + self._lease
                raise
            self._book.observer.claimed(len(rows))
            if len(self._rank) > 1 and len(rows) > 1:
                rows = sorted(rows, key=lambda row: self._rank[row.queue])  # priority kept
            # Slots may have freed while the claim ran: fill them, the rest waits.
            free = max(0, self._book.free_slots())
            for row in rows[:free]:
                self._executor.start(row, sent)
            if len(rows) > free:
                self._prefetch.add(rows[free:], sent, time.monotonic())
            if len(rows) == limit:
                return True, None
            await asyncio.sleep(0)  # let the new handlers start before asking
            until_due = (
                statements.SECONDS_UNTIL_DUE_GOVERNED if self._governed
                else statements.SECONDS_UNTIL_DUE
            )
            seconds = (await execute_async(conn, until_due, self._capabilities)).scalar_one()
        return False, None if seconds is None else float(seconds)

    async def hand_back_unknown(self) -> None:
        """Release what a claim of unknown outcome took (used at shutdown)."""
        if self._unknown_until:
            async with self._connection.use() as conn:
                await self._hand_back_unknown(conn)

    async def _hand_back_unknown(self, conn: AsyncConnection) -> None:
        rows = (await conn.execute(statements.OWNED, {"worker_id": self._worker_id})).all()
        orphans = [
            lease
            for lease in (Lease(r.id, r.attempt, r.lease_token) for r in rows)
            if not self._book.holds(lease) and not self._prefetch.holds(lease)
        ]
        if orphans:
            released = (
                await conn.execute(statements.RELEASE, statements.release_params(orphans))
            ).all()
            logger.warning(
                "handed back %d task(s) claimed by a claim whose outcome was unknown",
                len(released),
            )
        if time.monotonic() >= self._unknown_until:
            self._unknown_until = 0.0
