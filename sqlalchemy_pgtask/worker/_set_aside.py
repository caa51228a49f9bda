"""worker._set_aside: the items a batched maintenance pass could not handle, rested for a while.

A pass (wait timeouts, lease recovery, rescue) works on batches of tasks. One task whose rows
another transaction holds (an open ``cancel()``, a ``FOR UPDATE`` on a descendant) or whose
statement runs past ``statement_timeout`` must not stop the others: the pass skips what is
locked, or after a failed batch tries the items one at a time, and whatever still fails is set
aside here. A set-aside task is left out of the batches until its rest ends (1 s, doubling to
30 s while it stays held), then tried again alone before the next batch (held still, it would
fail the batch again), so the time its tries cost (up to one ``lock_timeout`` or
``statement_timeout`` each) stays bounded. Each rest is logged with the task id and the
reason.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final

from sqlalchemy import Executable, Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask._failures import held_back

__all__ = ["SetAside", "batched", "cut_short"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: The first and the longest rest of a task set aside.
REST_FIRST: Final = 1.0
REST_MAX: Final = 30.0


def cut_short(exc: BaseException) -> str | None:
    """Why ``exc`` ended one item's statement without saying anything about the others
    (`sqlalchemy_pgtask._failures.HELD_BACK`), or None for any other error."""
    return held_back(exc) if isinstance(exc, DBAPIError) else None


class SetAside:
    """Tasks one pass leaves out of its batches for a while (see the module)."""

    def __init__(self, what: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        #: What the pass does to a task, for the log ("wait timeout", "recovery").
        self.what = what
        self._clock = clock
        #: Task id -> (monotonic time its rest ends, the length of that rest).
        self._resting: dict[uuid.UUID, tuple[float, float]] = {}

    def resting(self) -> list[uuid.UUID]:
        """The tasks to leave out of the batches now."""
        now = self._clock()
        # One whose rest ended long ago was handled some other way (a signal woke it, its
        # lease was renewed): forget it, so the set stays as small as what is held.
        for key in [k for k, (until, _) in self._resting.items() if until + REST_MAX < now]:
            del self._resting[key]
        return [key for key, (until, _) in self._resting.items() if until > now]

    def due(self) -> list[uuid.UUID]:
        """The tasks whose rest has ended: to try alone, before (not inside) a batch."""
        now = self._clock()
        return [key for key, (until, _) in self._resting.items() if until <= now]

    def hold(self, key: uuid.UUID, reason: str) -> None:
        """Set ``key`` aside: its first rest, or one twice as long as its last."""
        previous = self._resting.get(key)
        rest = REST_FIRST if previous is None else min(REST_MAX, 2 * previous[1])
        self._resting[key] = (self._clock() + rest, rest)
        logger.warning(
            "%s of task %s held back (%s); set aside for %.1fs", self.what, key, reason, rest
        )

    def release(self, keys: list[uuid.UUID]) -> None:
        """``keys`` were handled: forget them."""
        for key in keys:
            self._resting.pop(key, None)

    def until_next(self) -> float | None:
        """Seconds until the next rest ends, or None when no task is resting.

        One whose rest has ended is only remembered (so that its next rest doubles): it is
        tried with the next pass, which must not be run back to back for it.
        """
        now = self._clock()
        ends = [until for until, _ in self._resting.values() if until > now]
        return min(ends) - now if ends else None

    def __len__(self) -> int:
        return len(self._resting)


async def batched(
    connection: AsyncConnection, aside: SetAside, params: Mapping[str, Any], *,
    batch: Executable, listing: Executable, one: Executable,
) -> list[Row[Any]]:
    """Run ``batch`` (bound with ``params`` and ``aside``: the tasks resting); if another
    transaction or a timeout cuts it short, run ``one`` for each task ``listing`` names
    (``task`` bound), and set aside each that is cut short again. ``connection`` is in
    autocommit: each statement is its own transaction. Returns the rows of what ran.

    A task whose rest has ended is tried alone first (one still held would otherwise fail
    the batch again, and roll back the others' work with it): set aside again if cut short,
    forgotten if there is nothing left to do for it.
    """
    rows: list[Row[Any]] = []
    tried = aside.due()
    for task in tried:
        alone = await _alone(connection, aside, one, params, task)
        if alone == []:
            aside.release([task])  # handled some other way meanwhile
        rows.extend(alone or ())
    # Those just tried stay out of the batch whatever happened: a wait reported held is set
    # aside by the caller, after this returns.
    resting = list({*aside.resting(), *tried})
    try:
        rows.extend((await connection.execute(batch, {**params, "aside": resting})).all())
        return rows
    except DBAPIError as exc:
        reason = cut_short(exc)
        if reason is None:
            raise
        await connection.rollback()
        logger.info("%s of a batch was cut short (%s); one by one now", aside.what, reason)
    ids = (await connection.execute(listing, {**params, "aside": resting})).scalars().all()
    for task in ids:
        rows.extend(await _alone(connection, aside, one, params, task) or ())
    return rows


async def _alone(
    connection: AsyncConnection, aside: SetAside, one: Executable, params: Mapping[str, Any],
    task: uuid.UUID,
) -> list[Row[Any]] | None:
    """``one`` for ``task``: its rows, or None (and ``task`` set aside) if it was cut short."""
    try:
        return list((await connection.execute(one, {**params, "task": task})).all())
    except DBAPIError as exc:
        reason = cut_short(exc)
        if reason is None:
            raise
        await connection.rollback()
        aside.hold(task, reason)
        return None
