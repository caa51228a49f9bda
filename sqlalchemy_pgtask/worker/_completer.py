"""worker._completer: writes outcomes in batches, one fenced statement per kind; never loses one.

An outcome leaves the completer only when it is written, or when its lease is known to be gone
(someone else owns the task now, and this attempt may write nothing). Everything in between is
retried:

* a row another transaction holds locked is skipped by the statement (it never waits) and
  set aside to be written on a later try, while other outcomes go on being written;
* a transient failure (the connection broke) leaves the commit's outcome unknown: the lease
  state is re-read, and what is still held is written again;
* a batch the database rejects, or that had to wait for a lock another transaction holds (a
  finished child's waiting parent, a descendant its end cancels) or ran past
  ``statement_timeout``, is written one outcome at a time, so one outcome cannot hold the
  others back (one that meets the lock or the timeout on its own is set aside, as a skipped
  row is, and tried again later); an outcome rejected on its own is
  recorded as an ``outcome_rejected`` failure instead. If even that is refused, the
  installation is broken (permissions, schema): the completer raises and the worker stops
  rather than renew leases it can never settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask._driver_sql import execute_async
from sqlalchemy_pgtask.outcome import Outcome, WriteKind, error_document
from sqlalchemy_pgtask.statements import Lease
from sqlalchemy_pgtask.states import RUNNING
from sqlalchemy_pgtask.worker._attempts import ActiveAttempt, AttemptBook
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient

__all__ = ["Completer"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")


@dataclass(eq=False)
class _Pending:
    attempt: ActiveAttempt
    outcome: Outcome
    #: Times its row was found locked by another transaction.
    skipped: int = 0


class Completer:
    """The outcome writer: one loop, one held connection."""

    def __init__(self, *, connection: HeldConnection, book: AttemptBook, batch_size: int) -> None:
        self._connection = connection
        self._book = book
        self._batch_size = batch_size
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        #: Outcomes whose row was locked, with the monotonic time to try them again.
        self._later: list[tuple[float, _Pending]] = []

    def submit(self, attempt: ActiveAttempt, outcome: Outcome) -> None:
        self._queue.put_nowait(_Pending(attempt, outcome))

    async def run(self) -> None:
        while True:
            skipped = await self._write(await self._next_batch())
            now = time.monotonic()
            for item in skipped:
                item.skipped += 1
                self._later.append((now + min(2.0, 0.05 * 2**item.skipped), item))

    async def _next_batch(self) -> list[_Pending]:
        """Outcomes due for a write: new ones, and set-aside ones whose moment has come."""
        while True:
            now = time.monotonic()
            batch = [item for due, item in self._later if due <= now]
            if batch:
                self._later = [(due, item) for due, item in self._later if due > now]
            if not batch and self._queue.empty():
                if not self._later:
                    batch.append(await self._queue.get())
                else:
                    wait = min(due for due, _ in self._later) - now
                    with contextlib.suppress(TimeoutError):
                        batch.append(await bounded(self._queue.get(), wait))
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if batch:
                return batch

    async def _write(self, batch: list[_Pending]) -> list[_Pending]:
        """Write ``batch``; return what was skipped because another transaction holds it."""
        backoff = Backoff(base=0.02, cap=2.0)
        pending = batch
        while True:
            try:
                return await self._write_batch(pending)
            except Exception as exc:
                if not is_transient(exc):
                    logger.exception("writing %d outcome(s) failed; one by one now", len(pending))
                    return await self._one_by_one(pending)
                if _cut_short(exc):
                    # A row one outcome needs (its waiting parent, a descendant it cancels)
                    # is held by another transaction, or one outcome's triggers ran past
                    # statement_timeout: write the others now, that one later. Alone, it is
                    # set aside like a skipped row: retried here, it would hold back every
                    # outcome queued behind it for as long as the lock is held (for ever, if
                    # it always runs too long). Nothing was committed.
                    logger.info("writing %d outcome(s) was cut short (%s); %s", len(pending),
                                brief(exc), "one by one now" if len(pending) > 1 else "later")
                    if len(pending) == 1:
                        return list(pending)
                    return await self._one_by_one(pending)
                logger.warning("writing outcomes failed (%s); retrying", brief(exc))
                await asyncio.sleep(backoff.next())
                pending = await self._still_held(pending)
                if not pending:
                    return []

    async def _write_batch(self, batch: Sequence[_Pending]) -> list[_Pending]:
        """Write ``batch``; return what is still held but was skipped (its row was locked)."""
        by_kind: dict[WriteKind, list[_Pending]] = {}
        for item in batch:
            by_kind.setdefault(item.outcome.kind, []).append(item)
        unwritten: list[_Pending] = []
        async with self._connection.use() as conn:
            for kind, group in by_kind.items():
                written = await _execute(conn, kind, group)
                for item in group:
                    if item.attempt.task_id in written:
                        self._book.forget(item.attempt)
                    else:
                        unwritten.append(item)
        if not unwritten:
            return []
        return await self._still_held(unwritten)

    async def _still_held(self, batch: Sequence[_Pending]) -> list[_Pending]:
        """Keep what still holds its lease; forget the rest (written before, or lease lost)."""
        backoff = Backoff(cap=2.0)
        while True:
            try:
                async with self._connection.use() as conn:
                    rows = (
                        await conn.execute(
                            statements.LEASES, {"ids": [p.attempt.task_id for p in batch]}
                        )
                    ).all()
                break
            except Exception as exc:
                if not is_transient(exc):
                    raise
                await asyncio.sleep(backoff.next())
        held = {
            Lease(r.id, r.attempt, r.lease_token) for r in rows if r.state == RUNNING
        }
        keep = []
        for item in batch:
            if item.attempt.lease in held:
                keep.append(item)
            else:
                # Either this write landed before the connection broke, or the lease is gone
                # (expired and recovered, or the task cancelled): nothing more to write.
                logger.info(
                    "task %s attempt %d no longer holds its lease; its %s is settled",
                    item.attempt.task_id, item.attempt.lease.attempt, item.outcome.kind,
                )
                self._book.forget(item.attempt)
        return keep

    async def _one_by_one(self, batch: Sequence[_Pending]) -> list[_Pending]:
        """Write each outcome on its own; return what to try again later."""
        later: list[_Pending] = []
        for item in batch:
            try:
                later += await self._write_batch([item])
                continue
            except Exception as exc:
                if is_transient(exc):
                    later.append(item)  # its lease is re-read when it is written again
                    continue
                logger.exception("task %s: outcome rejected", item.attempt.task_id)
                # Never leave a task to retry the same unwritable outcome forever.
                rejected = Outcome(
                    "fail", error_document("outcome_rejected", exc), None, "outcome_rejected"
                )
                fallback = _Pending(item.attempt, rejected)
            try:
                later += await self._write_batch([fallback])
            except Exception as exc:
                if not is_transient(exc):
                    raise  # not even a failure can be recorded: the installation is broken
                later.append(fallback)
        return later


#: SQLSTATEs of a statement stopped before its commit by what one of its rows needed: 55P03, a
#: ``NOWAIT`` lock or one that ran out of ``lock_timeout``; 57014, ``statement_timeout`` (or
#: an operator's ``pg_cancel_backend``).
_CUT_SHORT: Final = frozenset({"55P03", "57014"})


def _cut_short(exc: BaseException) -> bool:
    """Whether the write failed, uncommitted, on a lock or a timeout (see `_CUT_SHORT`)."""
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return getattr(cause, "sqlstate", None) in _CUT_SHORT


async def _execute(
    conn: AsyncConnection, kind: WriteKind, group: Sequence[_Pending]
) -> set[uuid.UUID]:
    leases = [item.attempt.lease for item in group]
    if kind == "complete":
        results = [item.outcome.document or "null" for item in group]
        rows = await execute_async(
            conn, statements.COMPLETE, statements.complete_params(leases, results)
        )
    elif kind == "fail":
        rows = await execute_async(
            conn,
            statements.FAIL,
            statements.fail_params(
                leases,
                [item.outcome.document or "{}" for item in group],
                [item.outcome.delay for item in group],
            ),
        )
    else:
        rows = await execute_async(
            conn,
            statements.RELEASE,
            statements.release_params(leases, [item.outcome.delay or 0.0 for item in group]),
        )
    return {row.id for row in rows.all()}
