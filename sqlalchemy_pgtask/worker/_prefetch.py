"""worker._prefetch: tasks claimed ahead of free slots, while handlers finish fast.

With short handlers most of a task's cost is its share of a claim statement (a round trip, a
plan, an index walk), so a worker that claims only for the slots that just freed pays for a
statement per ``concurrency`` tasks at best. When handlers finish fast, the claim takes more
than the free slots: the extra tasks wait here, claimed (running under this worker in the
database, their attempt started), and start as slots free.

How many wait is how many would start within `HORIZON` seconds at the pace handlers finished
over the last `WINDOW` seconds, at most ``prefetch``; and none unless one finished within the
horizon (slots held by handlers that run on start nothing soon, whatever the earlier pace).
A worker that finishes fewer than one handler per horizon claims exactly its free slots, as
does one that has not finished a handler yet: what it holds back from other workers is about
a horizon's work. The pace is taken over a window longer than the horizon because handlers
started together finish together: a burst of finishes says little of when the next slot
frees.

A waiting row is stale once it waited `MAX_WAIT` (at most a quarter of the lease, since
waiting leases are not renewed, and of its time limit, which runs from its claim): the claim
loop then hands it back (released through the outcome writer: no failed attempt is
counted), as it does with every waiting row when the worker stops.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Row

from sqlalchemy_pgtask.statements import Lease

__all__ = ["HORIZON", "MAX_WAIT", "Prefetch", "Waiting"]

#: Seconds of work, at the recent pace, that the worker keeps claimed ahead.
HORIZON: Final = 0.05
#: Seconds over which the pace of finishing handlers is counted (in `HORIZON`-long buckets).
WINDOW: Final = 1.0
#: The longest a claimed task waits for a slot before it is handed back (seconds).
MAX_WAIT: Final = 1.0
_BUCKETS: Final = round(WINDOW / HORIZON)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A claimed row that waits for a slot."""

    row: Row[Any]
    #: Monotonic time its claim was sent (the lease runs from no earlier than this).
    sent: float
    #: Monotonic time its claim's answer arrived (its time limit runs from no later).
    arrived: float
    #: Monotonic time after which it is handed back rather than started.
    stale_at: float

    @property
    def lease(self) -> Lease:
        return Lease(self.row.id, self.row.attempt, self.row.lease_token)


class Prefetch:
    """The claimed rows waiting for a slot, and how many more the next claim may take."""

    def __init__(self, limit: int, lease_seconds: float) -> None:
        self.limit = limit
        self.max_wait = min(MAX_WAIT, lease_seconds / 4)
        #: In claim order: the claim returns the rows it took in the order it took them.
        self._waiting: collections.deque[Waiting] = collections.deque()
        #: No waiting row is stale before this (a lower bound, made exact by `take_stale`):
        #: most passes of the claim loop then look at no row at all.
        self._earliest_stale = float("inf")
        #: Handlers finished per horizon-long bucket over the window (a ring).
        self._counts = [0] * _BUCKETS
        self._bucket = 0
        self._last_finished = float("-inf")

    def __len__(self) -> int:
        return len(self._waiting)

    def finished(self, now: float) -> None:
        """A handler finished (its slot freed) at monotonic time ``now``."""
        self._advance(now)
        self._counts[self._bucket % _BUCKETS] += 1
        self._last_finished = now

    def target(self, now: float) -> int:
        """How many should wait: those that would start within the horizon, at most the limit."""
        if not self.limit or now - self._last_finished > HORIZON:
            return 0
        self._advance(now)
        return min(self.limit, int(sum(self._counts) * HORIZON / WINDOW))

    def _advance(self, now: float) -> None:
        """Move the ring to ``now``'s bucket, emptying the buckets it passes."""
        bucket = int(now / HORIZON)
        if bucket == self._bucket:
            return
        if bucket - self._bucket >= _BUCKETS:
            self._counts = [0] * _BUCKETS
        else:
            for passed in range(self._bucket + 1, bucket + 1):
                self._counts[passed % _BUCKETS] = 0
        self._bucket = bucket

    def claim_size(self, free: int, now: float, *, ahead: bool) -> int:
        """How many tasks the next claim asks for, given ``free`` slots (0: do not claim).

        Rows wait only while no slot is free (they are started first). Beyond the free
        slots only if ``ahead`` (the caller knows whether claiming ahead is wise now), and
        only once at most a quarter of the target still waits: claims of a few rows each
        would cost what this saves.
        """
        if not ahead:
            return free
        target = self.target(now)
        waiting = len(self._waiting)
        if waiting > target // 4:
            return free
        return free + target - waiting

    def add(self, rows: Sequence[Row[Any]], sent: float, arrived: float) -> None:
        for row in rows:
            wait = self.max_wait if row.time_limit is None else min(
                self.max_wait, row.time_limit / 4
            )
            self._waiting.append(Waiting(row, sent, arrived, arrived + wait))
            self._earliest_stale = min(self._earliest_stale, arrived + wait)

    def take(self, count: int) -> list[Waiting]:
        """Remove and return up to ``count`` waiting rows, oldest claim first."""
        return [self._waiting.popleft() for _ in range(min(count, len(self._waiting)))]

    def take_stale(self, now: float) -> list[Waiting]:
        """Remove and return the rows that are stale at ``now``."""
        if now < self._earliest_stale:
            return []
        stale = [w for w in self._waiting if w.stale_at <= now]
        if stale:
            self._waiting = collections.deque(w for w in self._waiting if w.stale_at > now)
        self._earliest_stale = min((w.stale_at for w in self._waiting), default=float("inf"))
        return stale

    def until_stale(self, now: float) -> float | None:
        """Seconds until the next row may turn stale (None: nothing waits)."""
        if not self._waiting:
            return None
        return max(0.0, self._earliest_stale - now)

    def holds(self, lease: Lease) -> bool:
        return any(w.lease == lease for w in self._waiting)
