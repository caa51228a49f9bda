"""worker._schedule: every worker materialises due schedule occurrences; and the declared ones
are reconciled at start.

`Schedules` is a `MaintenanceService`: each pass runs a few short transactions on the
worker's maintenance connection (see `sqlalchemy_pgtask.schedule.materialize`), then says how long
until the next schedule falls due, so the worker sleeps exactly until then. No leader: any
number of workers run it at once, and a schedule one of them holds is skipped by the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.schedule.api import (
    MaterializeReport,
    ScheduleInfo,
    materialize_schedules_async,
    write_declared,
)
from sqlalchemy_pgtask.statements.schedule import SECONDS_UNTIL_NEXT_SCHEDULE
from sqlalchemy_pgtask.worker._maintenance import MAX_BATCHES_PER_PASS

__all__ = ["Schedules", "reconcile_schedules"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: Seconds before looking again at due schedules another materialiser held.
_HELD_RETRY: Final = 0.5
#: The first and the longest rest of a schedule another transaction holds back.
_HELD_REST_FIRST: Final = 1.0
_HELD_REST_MAX: Final = 30.0


async def _pass(
    connection: AsyncConnection, limit: int, exclude: Sequence[str]
) -> MaterializeReport:
    """One materialisation transaction on the worker's autocommit connection (its
    occurrences computed in a thread, off the event loop: `materialize_schedules_async`)."""
    await connection.execute(text("BEGIN"))
    try:
        report = await materialize_schedules_async(connection, limit=limit, exclude=exclude)
    except BaseException:
        with contextlib.suppress(Exception):
            await connection.execute(text("ROLLBACK"))
        raise
    await connection.execute(text("COMMIT"))
    return report


class Schedules:
    """Materialises due schedule occurrences; returns the seconds until the next one."""

    name = "schedules"

    def __init__(self, *, interval: float = 1.0, batch_size: int = 100) -> None:
        #: The longest sleep: bounds how late a schedule created meanwhile is noticed.
        self.interval = interval
        self._batch = batch_size
        #: Schedules held back by another transaction: (monotonic time they rest until,
        #: the length of that rest). Each try costs up to a lock or statement timeout, so
        #: the rest doubles while they stay held, up to `_HELD_REST_MAX`.
        self._resting: dict[str, tuple[float, float]] = {}

    async def run_once(self, connection: AsyncConnection) -> float | None:
        """One pass on an autocommit connection; each batch is its own transaction.

        Looks before it locks: with nothing due, a pass is one read of ``ix_schedules_due``.
        """
        now = time.monotonic()
        tried = {name for name, (until, _) in self._resting.items() if until <= now}
        # Waiting for room in their queue, or held back: not again this pass.
        skipped = [name for name in self._resting if name not in tried]
        held: set[str] = set()
        seconds = await self._until_next(connection, skipped)
        for _ in range(MAX_BATCHES_PER_PASS):
            if seconds is None or seconds > 0:
                break
            report = await _pass(connection, self._batch, list(skipped))
            if report.created:
                logger.info("materialised %d scheduled task(s)", report.created)
            skipped.extend(report.waiting + report.held)
            held.update(report.held)
            seconds = await self._until_next(connection, skipped)
            if report.selected < self._batch and seconds is not None and seconds <= 0:
                # Still due: held by another materialiser, or more than one pass could take.
                seconds = min(self.interval, _HELD_RETRY)
                break
        else:
            if seconds is not None and seconds <= 0:
                seconds = min(self.interval, _HELD_RETRY)
        self._rest(held, tried)
        if self._resting:
            until = max(0.0, min(until for until, _ in self._resting.values()) - time.monotonic())
            seconds = until if seconds is None else min(seconds, until)
        return seconds

    def _rest(self, held: set[str], tried: set[str]) -> None:
        for name in tried - held:  # tried again and not held: back to normal
            del self._resting[name]
        for name in sorted(held):
            previous = self._resting.get(name)
            rest = _HELD_REST_FIRST if previous is None else min(_HELD_REST_MAX, 2 * previous[1])
            self._resting[name] = (time.monotonic() + rest, rest)
            logger.info("schedule %r rests %.1fs before it is tried again", name, rest)

    @staticmethod
    async def _until_next(connection: AsyncConnection, skipped: list[str]) -> float | None:
        """Seconds until the next schedule falls due (None: nothing scheduled, or only
        schedules of full queues: look again at the interval)."""
        seconds = (
            await connection.execute(SECONDS_UNTIL_NEXT_SCHEDULE, {"exclude": skipped})
        ).scalar()
        return None if seconds is None else float(seconds)


async def reconcile_schedules(
    connection: AsyncConnection, registry: Registry, *, actor: str | None = None
) -> list[ScheduleInfo]:
    """Write the schedules declared in ``registry`` (``declared`` true), in ``connection``'s
    transaction, which the caller commits: a new or changed definition is written (a changed
    one restarts from database now), an unchanged one keeps its cursor and writes nothing.
    Schedules no longer declared are left alone (delete them with ``pgtask schedule delete``).
    """
    written = []
    for declared in registry.schedules:
        written.append(await connection.run_sync(write_declared, declared.spec, actor))
    if written:
        logger.info("reconciled %d declared schedule(s)", len(written))
    return written
