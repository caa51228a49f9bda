"""worker._retention: the worker's retention pass, a `MaintenanceService`.

Every worker runs it on an interval; nothing needs a leader. Each batch is one statement on
the maintenance connection (autocommit: a transaction of its own), skipping rows other
workers' passes hold, so passes running at once share the work. A pass runs at most
`MAX_BATCHES_PER_PASS` batches of each kind and yields to the other services; a backlog is
worked off over the following passes. Worker rows are left to `WorkerPruning`.

A pass locks only finished tasks and idempotency reservations, never a task a claim could
take: a failed, slow or stuck pass never holds up claims. A root whose family's deletion
failed alone (a row of its history another transaction holds) rests across passes: the
following passes leave it out of their batches for one pass interval, then twice as long each
time it fails again (up to 16 intervals), so a row held for long costs a lock_timeout and a
warning now and then, not on every pass.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime
from typing import Final

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask.retention import RetentionSweep, is_held
from sqlalchemy_pgtask.worker._maintenance import MAX_BATCHES_PER_PASS

__all__ = ["Retention"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: How often the reservations of tasks that still exist are read again from the oldest: the
#: cursors skip what was read, and a reservation skipped because another transaction held it
#: (a concurrent pass that then rolled back) is found on the next full read.
_REREAD_SECONDS: Final = 24 * 3600.0
#: Seconds before the next pass when this one stopped at its batch limit with work left: a
#: backlog drains pass after pass, each yielding to the other services in between.
_BACKLOG_PAUSE: Final = 0.1
#: A set-aside root's first rest (at least), and its longest, in pass intervals.
_REST_FIRST: Final = 1.0
_REST_MAX_INTERVALS: Final = 16


class Retention:
    """Deletes expired finished tasks and idempotency reservations, in bounded batches."""

    name = "retention"

    def __init__(self, *, interval: float, batch_size: int) -> None:
        self.interval = interval
        self._batch = batch_size
        self._cursors: dict[str, datetime] = {}
        self._reread_at = time.monotonic() + _REREAD_SECONDS
        #: Root id -> (monotonic time its rest ends, the length of that rest).
        self._resting: dict[uuid.UUID, tuple[float, float]] = {}
        self._rest_max = max(_REST_FIRST, self.interval) * _REST_MAX_INTERVALS

    def _still_resting(self) -> list[uuid.UUID]:
        now = time.monotonic()
        # A root whose rest ended long ago went another way (another pass or run deleted it):
        # forget it, so the map stays as small as what is held.
        for root in [r for r, (until, _) in self._resting.items() if until + self._rest_max < now]:
            del self._resting[root]
        return [root for root, (until, _) in self._resting.items() if until > now]

    def _rest(self, root: uuid.UUID) -> str:
        previous = self._resting.get(root)
        first = max(_REST_FIRST, self.interval)
        rest = first if previous is None else min(self._rest_max, 2 * previous[1])
        self._resting[root] = (time.monotonic() + rest, rest)
        return f"this worker's passes leave it out for {rest:.1f}s"

    async def run_once(self, connection: AsyncConnection) -> float | None:
        if time.monotonic() >= self._reread_at:
            self._cursors.clear()
            self._reread_at = time.monotonic() + _REREAD_SECONDS
        sweep = RetentionSweep(
            queue=None,
            batch_size=self._batch,
            max_batches=MAX_BATCHES_PER_PASS,
            worker_retention=None,
            cursors=self._cursors,
            skip=self._still_resting(),
            rest=self._rest,
        )
        steps = sweep.steps()
        try:
            step = next(steps)
            while True:
                try:
                    rows = (await connection.execute(*step)).all()
                except DBAPIError as exc:
                    if not is_held(exc):
                        raise
                    step = steps.throw(exc)  # the sweep works around the held row
                    continue
                step = steps.send(rows)
        except StopIteration:
            pass
        except BaseException:
            # A batch that failed may have left rows behind the cursors: read from the start.
            self._cursors.clear()
            raise
        finally:
            if sweep.tasks_deleted or sweep.keys_deleted:
                logger.info(
                    "retention deleted %d finished task(s) and %d idempotency key(s)",
                    sweep.tasks_deleted, sweep.keys_deleted,
                )
        return min(self.interval, _BACKLOG_PAUSE) if sweep.cut_short else None
