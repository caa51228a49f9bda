"""worker._completer: writes outcomes in batches, one fenced statement per kind; never loses one.

An outcome leaves the completer when it is written, when its lease is known to be gone
(someone else owns the task now, and this attempt may write nothing), or when it is given up
(below). Everything in between is retried:

* a row another transaction holds locked is skipped by the statement (it never waits) and
  set aside to be written on a later try, while other outcomes go on being written;
* a transient failure (the connection broke) leaves the commit's outcome unknown: the lease
  state is re-read, and what is still held is written again;
* a batch the database rejects, or that had to wait for a lock another transaction holds (a
  finished child's waiting parent, a descendant its end cancels) or ran past
  ``statement_timeout``, is written one outcome at a time, so one outcome cannot hold the
  others back; an outcome rejected on its own is recorded as an ``outcome_rejected``
  failure instead. If even that is refused, the installation is broken (permissions,
  schema): the completer raises and the worker stops rather than renew leases it can never
  settle.

An outcome cut short on its own (SQLSTATE 55P03 or 57014) is set aside and tried again alone,
after waits that double from 0.1 s up to a sixth of the lease, never in a batch it would hold
back. Each such try costs the writer up to ``lock_timeout`` or ``statement_timeout``, so the
tries are bounded: at the tenth, or at the second that ran past ``statement_timeout``, the
outcome is **given up**. Its lease is no longer renewed, so it expires and recovery takes the
task back as it would a dead worker's (the attempt counts as failed, ``lease_expired``, and the
task retries by its policy). The give-up is logged with the task id and counted.
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
from sqlalchemy_pgtask._failures import HELD_BACK
from sqlalchemy_pgtask.outcome import Outcome, WriteKind, error_document
from sqlalchemy_pgtask.statements import Lease
from sqlalchemy_pgtask.states import RUNNING
from sqlalchemy_pgtask.worker._attempts import ActiveAttempt, AttemptBook
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient

__all__ = ["Completer"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")


#: SQLSTATEs of a statement stopped before its commit by what one of its rows needed: 55P03, a
#: ``NOWAIT`` lock or one that ran out of ``lock_timeout``; 57014, ``statement_timeout`` (or
#: an operator's ``pg_cancel_backend``).
#: (Not a deadlock or a serialisation failure: those are retried like any transient failure.)
_CUT_SHORT: Final = {state: HELD_BACK[state] for state in ("55P03", "57014")}
#: Tries alone, cut short, at which an outcome is given up: in all, and of those that ran
#: past ``statement_timeout`` (each held the writer, and every outcome behind it, that long).
_MAX_CUT_SHORT: Final = 10
_MAX_TIMED_OUT: Final = 2


@dataclass(eq=False)
class _Pending:
    attempt: ActiveAttempt
    outcome: Outcome
    #: Times its row was found locked by another transaction (or a try of it alone broke).
    skipped: int = 0
    #: Tries of it alone that were cut short, and how many of them by statement_timeout.
    cut_short: int = 0
    timed_out: int = 0


class Completer:
    """The outcome writer: one loop, one held connection."""

    def __init__(
        self, *, connection: HeldConnection, book: AttemptBook, batch_size: int,
        lease_seconds: float,
    ) -> None:
        self._connection = connection
        self._book = book
        self._batch_size = batch_size
        #: The longest wait before a cut-short outcome is tried again.
        self._longest_wait = max(0.1, lease_seconds / 6)
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        #: Outcomes set aside, with the monotonic time to try them again.
        self._later: list[tuple[float, _Pending]] = []

    @property
    def set_aside(self) -> int:
        """Outcomes waiting to be tried again (for the metrics)."""
        return len(self._later)

    def submit(self, attempt: ActiveAttempt, outcome: Outcome) -> None:
        self._queue.put_nowait(_Pending(attempt, outcome))

    async def run(self) -> None:
        while True:
            await self._write(await self._next_batch())

    def _set_aside(self, item: _Pending, failure: BaseException | None = None) -> None:
        """Try ``item`` again later: it was skipped (a locked row), or ``failure`` stopped it."""
        reason = _cut_short(failure) if failure is not None else None
        if reason is None:
            item.skipped += 1
            wait = min(2.0, 0.05 * 2**item.skipped)
        else:
            item.cut_short += 1
            item.timed_out += reason == "statement_timeout"
            if item.cut_short >= _MAX_CUT_SHORT or item.timed_out >= _MAX_TIMED_OUT:
                self._give_up(item, reason, failure)
                return
            wait = min(self._longest_wait, 0.1 * 2 ** (item.cut_short - 1))
            logger.info(
                "task %s attempt %d: its %s was cut short (%s); set aside, try %d again in "
                "%.1fs", item.attempt.task_id, item.attempt.lease.attempt, item.outcome.kind,
                brief(failure) if failure is not None else reason, item.cut_short + 1, wait,
            )
        self._later.append((time.monotonic() + wait, item))

    def _give_up(self, item: _Pending, reason: str, failure: BaseException | None) -> None:
        attempt = item.attempt
        logger.warning(
            "task %s attempt %d: its %s was given up after %d tries cut short (last: %s); its "
            "lease is no longer renewed: recovery takes the task back once it expires",
            attempt.task_id, attempt.lease.attempt, item.outcome.kind, item.cut_short,
            brief(failure) if failure is not None else reason,
            extra={"task_id": str(attempt.task_id), "attempt": attempt.lease.attempt,
                   "outcome": "given_up", "reason": reason},
        )
        self._book.forget(attempt)
        self._book.observer.outcome_given_up(attempt, item.outcome, reason)

    async def _next_batch(self) -> list[_Pending]:
        """Outcomes due for a write: new ones, and set-aside ones whose moment has come (at
        most a batch); one that was cut short before goes alone, not to hold back a batch."""
        while True:
            now = time.monotonic()
            ready = sorted((entry for entry in self._later if entry[0] <= now), key=_first)
            alone = next((item for _, item in ready if item.cut_short), None)
            batch = [alone] if alone is not None else [i for _, i in ready[: self._batch_size]]
            taken = {id(item) for item in batch}
            self._later = [entry for entry in self._later if id(entry[1]) not in taken]
            if alone is not None:
                return batch
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

    async def _write(self, batch: list[_Pending]) -> None:
        """Write ``batch``; set aside what cannot be written now."""
        backoff = Backoff(base=0.02, cap=2.0)
        pending = batch
        while True:
            try:
                self._set_all_aside(await self._write_batch(pending))
                return
            except Exception as exc:
                if not is_transient(exc):
                    logger.exception("writing %d outcome(s) failed; one by one now", len(pending))
                    await self._one_by_one(pending)
                    return
                if _cut_short(exc):
                    # A row one outcome needs (its waiting parent, a descendant it cancels)
                    # is held by another transaction, or one outcome's triggers ran past
                    # statement_timeout: write the others now, that one later. Retried here,
                    # it would hold back every outcome queued behind it for as long as the
                    # lock is held (for ever, if it always runs too long). Nothing was
                    # committed.
                    logger.info("writing %d outcome(s) was cut short (%s); %s", len(pending),
                                brief(exc), "one by one now" if len(pending) > 1 else "later")
                    if len(pending) == 1:
                        self._set_aside(pending[0], exc)
                    else:
                        await self._one_by_one(pending)
                    return
                logger.warning("writing outcomes failed (%s); retrying", brief(exc))
                await asyncio.sleep(backoff.next())
                pending = await self._still_held(pending)
                if not pending:
                    return

    def _set_all_aside(self, skipped: Sequence[_Pending]) -> None:
        for item in skipped:
            self._set_aside(item)

    async def _write_batch(self, batch: Sequence[_Pending]) -> list[_Pending]:
        """Write ``batch``; return what is still held but was skipped (its row was locked)."""
        by_kind: dict[WriteKind, list[_Pending]] = {}
        for item in batch:
            by_kind.setdefault(item.outcome.kind, []).append(item)
        unwritten: list[_Pending] = []
        observer = self._book.observer
        async with self._connection.use() as conn:
            for kind, group in by_kind.items():
                written = await _execute(conn, kind, group)
                # A stale and a current outcome of one task may share a batch: the row says
                # only its id, and it can be the current one's alone (the higher attempt).
                newest: dict[uuid.UUID, _Pending] = {}
                for item in group:
                    known = newest.setdefault(item.attempt.task_id, item)
                    if item.attempt.lease.attempt > known.attempt.lease.attempt:
                        newest[item.attempt.task_id] = item
                for item in group:
                    state = written.get(item.attempt.task_id)
                    if state is None or newest[item.attempt.task_id] is not item:
                        unwritten.append(item)
                    else:
                        self._book.forget(item.attempt)
                        observer.outcome_written(item.attempt, item.outcome, state)
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
                self._book.observer.outcome_lost(item.attempt, item.outcome)
        return keep

    async def _one_by_one(self, batch: Sequence[_Pending]) -> None:
        """Write each outcome on its own; set aside what cannot be written now."""
        for item in batch:
            try:
                self._set_all_aside(await self._write_batch([item]))
                continue
            except Exception as exc:
                if is_transient(exc):
                    self._set_aside(item, exc)  # its lease is re-read when it is written again
                    continue
                logger.exception("task %s: outcome rejected", item.attempt.task_id)
                # Never leave a task to retry the same unwritable outcome forever.
                rejected = Outcome(
                    "fail", error_document("outcome_rejected", exc), None, "outcome_rejected"
                )
                fallback = _Pending(item.attempt, rejected)
            try:
                self._set_all_aside(await self._write_batch([fallback]))
            except Exception as exc:
                if not is_transient(exc):
                    raise  # not even a failure can be recorded: the installation is broken
                self._set_aside(fallback, exc)


def _first(entry: tuple[float, _Pending]) -> float:
    return entry[0]


def _cut_short(exc: BaseException) -> str | None:
    """Why the write failed, uncommitted, on a lock or a timeout (see `_CUT_SHORT`); None
    when it failed otherwise."""
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return _CUT_SHORT.get(getattr(cause, "sqlstate", None) or "")


async def _execute(
    conn: AsyncConnection, kind: WriteKind, group: Sequence[_Pending]
) -> dict[uuid.UUID, str]:
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
    return {row.id: row.state for row in rows.all()}
