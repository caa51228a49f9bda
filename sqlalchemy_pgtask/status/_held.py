"""status._held: work a background pass should have handled by now but has not.

A worker sets an item aside in its own memory (a wait whose rows another transaction holds,
an outcome that keeps failing), which no other process can read. What every process can read
is the consequence in the database: a wait timeout that is due but still waiting, a lease
that expired but is still running. Overdue by more than `HELD_BACK_AFTER` (database time)
means passes ran and did not apply it, or no pass runs at all; either way an operator should
look (``pgtask explain <id>`` says why).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Literal

from sqlalchemy import ColumnElement, Connection, Select, func, select

from sqlalchemy_pgtask.models import Task, Wait
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import RUNNING, WAITING
from sqlalchemy_pgtask.status._overview import state_in

__all__ = ["HELD_BACK_AFTER", "HELD_BACK_COUNT_MAX", "HeldBack", "HeldBackKind", "held_back"]

#: Seconds past due before work counts as held back. Lease recovery runs every third of the
#: lease duration (10 s by default) and the wait-timeout pass at least every 5 s, so 30 s is
#: several missed passes, not one pass that has not come round yet.
HELD_BACK_AFTER: Final = 30.0
#: Counting stops here (a count of this many means "at least"), so the statement reads at
#: most this many index entries however large a backlog is.
HELD_BACK_COUNT_MAX: Final = 1000

_Overdue = Select[uuid.UUID, datetime | None]

HeldBackKind = Literal["wait_timeout", "expired_lease"]
_NOUNS: Final[dict[HeldBackKind, str]] = {
    "wait_timeout": "wait timeout", "expired_lease": "expired lease",
}


@dataclass(frozen=True)
class HeldBack:
    """Overdue work of one kind: how many items, and the one overdue the longest."""

    kind: HeldBackKind
    #: Items overdue by more than the bound, at most `HELD_BACK_COUNT_MAX`.
    count: int
    oldest_task_id: uuid.UUID
    #: Seconds since the oldest item fell due (its ``timeout_at`` or ``lease_expires_at``).
    oldest_overdue_seconds: float

    @property
    def at_least(self) -> bool:
        """The count reached `HELD_BACK_COUNT_MAX`: there may be more."""
        return self.count >= HELD_BACK_COUNT_MAX

    @property
    def message(self) -> str:
        """One line for an operator: ``2 wait timeouts overdue (oldest task <id>, 34 s; see
        `pgtask explain <id>`)``."""
        what = _NOUNS[self.kind] + ("" if self.count == 1 else "s")
        return (
            f"{self.count}{'+' if self.at_least else ''} {what} overdue (oldest task"
            f" {self.oldest_task_id}, {self.oldest_overdue_seconds:.0f} s;"
            f" see `pgtask explain {self.oldest_task_id}`)"
        )


def _overdue_waits(cutoff: ColumnElement[Any]) -> _Overdue:
    # ix_waits_timeout_at serves the range and the order; the join reads one task per row.
    return (
        select(Wait.task_id.label("task_id"), Wait.timeout_at.label("due_at"))
        .join(Task, Task.id == Wait.task_id)
        .where(Wait.timeout_at.is_not(None), Wait.timeout_at <= cutoff, state_in((WAITING,)))
        .order_by(Wait.timeout_at)
        .limit(HELD_BACK_COUNT_MAX)
    )


def _expired_leases(cutoff: ColumnElement[Any]) -> _Overdue:
    # ix_tasks_lease_expiry (lease_expires_at, id) WHERE state = 'running' serves it all.
    return (
        select(Task.id.label("task_id"), Task.lease_expires_at.label("due_at"))
        .where(state_in((RUNNING,)), Task.lease_expires_at <= cutoff)
        .order_by(Task.lease_expires_at, Task.id)
        .limit(HELD_BACK_COUNT_MAX)
    )


def held_back(connection: Connection, *, after: float = HELD_BACK_AFTER) -> list[HeldBack]:
    """Due wait timeouts not applied and expired leases not recovered, each overdue by more
    than ``after`` seconds of database time; one entry per kind that has any.

    Two bounded statements: each reads at most `HELD_BACK_COUNT_MAX` entries of an index
    ordered by the due time, so the first row is the oldest.
    """
    if after < 0:
        raise ValueError(f"after must be >= 0 seconds, not {after!r}")
    cutoff = NOW - timedelta(seconds=after)
    out: list[HeldBack] = []
    kinds: tuple[tuple[HeldBackKind, _Overdue], ...] = (
        ("wait_timeout", _overdue_waits(cutoff)),
        ("expired_lease", _expired_leases(cutoff)),
    )
    for kind, overdue in kinds:
        rows = overdue.subquery()
        first = connection.execute(
            select(
                rows.c.task_id,
                func.extract("epoch", NOW - rows.c.due_at).label("overdue"),
                func.count().over().label("n"),
            )
            .order_by(rows.c.due_at, rows.c.task_id)
            .limit(1)
        ).first()
        if first is not None:
            out.append(HeldBack(kind, int(first.n), first.task_id, float(first.overdue)))
    return out
