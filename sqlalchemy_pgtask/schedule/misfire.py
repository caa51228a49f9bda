"""schedule.misfire: what the occurrences of a due schedule become (misfire and overlap policies);
pure, no I/O.

An occurrence late by at most the **grace** is on time: it is created whatever the policy,
so a materialiser that ran a little late (a busy machine, a pass held back, a worker woken
a moment after the occurrence) loses nothing. The grace is `MISFIRE_GRACE` (60 s), or
`GRACE_OCCURRENCES` (10) times the time between occurrences if that is shorter, so that the
occurrences it lets through after a downtime stay a handful. Only occurrences later than
that are *missed*, and the policy decides:

* ``skip``: none of them;
* ``latest``: the newest of them, and only when no occurrence is on time (the newest due
  occurrence stands for the ones before it);
* ``catch_up``: the newest ``catch_up_limit`` of them.

Under overlap ``skip`` occurrences must not run side by side: one task at most, the newest.
Every instant is an aware UTC `datetime`; "now" is database time, passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from sqlalchemy_pgtask.schedule.recurrence import Recurrence

__all__ = ["GRACE_OCCURRENCES", "MISFIRE_GRACE", "Occurrences", "grace", "plan_occurrences"]

#: How late an occurrence may be materialised and still count as on time, at most.
MISFIRE_GRACE: Final = timedelta(seconds=60)
#: ... and at most this many times the time between occurrences.
GRACE_OCCURRENCES: Final = 10
_TICK: Final = timedelta(microseconds=1)


@dataclass(frozen=True)
class Occurrences:
    """What one materialisation of a due schedule does."""

    #: The occurrences to create tasks for, oldest first.
    due: list[datetime]
    #: The cursor once they exist.
    next_run_at: datetime
    #: Whether older missed occurrences were dropped by the policy.
    dropped: bool


def grace(recurrence: Recurrence, occurrence: datetime, anchor: datetime) -> timedelta:
    """How late ``occurrence`` (and the ones before it) may be and still be on time."""
    gap = recurrence.next_after(occurrence, anchor) - occurrence
    return min(MISFIRE_GRACE, GRACE_OCCURRENCES * gap)


def _newest_first(recurrence: Recurrence, cursor: datetime, latest: datetime) -> Iterator[datetime]:
    """The due occurrences from ``latest`` back to the cursor (which counts as one)."""
    occurrence = latest
    yield occurrence
    while occurrence > cursor:
        occurrence = max(recurrence.latest(occurrence - _TICK, cursor), cursor)
        yield occurrence


def plan_occurrences(
    recurrence: Recurrence,
    *,
    cursor: datetime,
    now: datetime,
    misfire: str,
    catch_up_limit: int | None,
    previous_active: bool,
    overlap: str = "allow",
    waiting: bool = False,
) -> Occurrences:
    """Apply the grace, then the misfire and overlap policies, to a schedule whose cursor is
    due (<= now).

    ``waiting``: the cursor is an occurrence that was on time but found its queue full; it
    stays on time until a newer occurrence falls due, however late it gets.
    """
    following = recurrence.next_after(now, cursor)
    latest = max(recurrence.latest(now, cursor), cursor)
    if previous_active:  # overlap "skip": the previous occurrence's task is still active
        return Occurrences([], following, dropped=True)
    limit = now - grace(recurrence, latest, cursor)
    on_time: list[datetime] = []
    missed: list[datetime] = []
    older = _newest_first(recurrence, cursor, latest)
    for occurrence in older:
        if occurrence >= limit or (waiting and occurrence == cursor == latest):
            on_time.append(occurrence)
            if occurrence == cursor:
                break
            continue
        # The first missed one; the older ones are only read as far as the policy takes.
        if misfire == "latest" and not on_time:
            missed = [occurrence]
        elif misfire == "catch_up":
            missed = [occurrence]
            for _, before in zip(range((catch_up_limit or 1) - 1), older, strict=False):
                missed.append(before)
        break
    newest_first = on_time + missed
    if overlap == "skip":
        newest_first = newest_first[:1]
    due = newest_first[::-1]
    return Occurrences(due, following, dropped=not due or due[0] != cursor)
