"""explain.keyed: whether a pending task waits for its concurrency key, and who holds it;
only ``SELECT`` statements, never a lock.

The same rule as the claim's (``pgtask.concurrency_admits``, revision pgtask_0016), read
without its lock: the key has fewer holders than its limit, and the task is among the first
(limit - holders) due tasks of its key in claim order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, and_, func, literal_column, or_, select

from sqlalchemy_pgtask.explain.facts import Facts
from sqlalchemy_pgtask.explain.reasons import Reason
from sqlalchemy_pgtask.models import HandlerPolicy, Task
from sqlalchemy_pgtask.statements import NOW

__all__ = ["KeyFacts", "key_reason", "read_key"]

#: Holders named in a sentence; the others are counted.
_NAMED: Final = 5
#: Tasks ahead of it counted at most (a hot key's backlog need not be counted whole).
_AHEAD_MAX: Final = 1000


@dataclass(frozen=True)
class KeyFacts:
    """A keyed task's key: its limit, who holds it, and how many due tasks are before it."""

    key: str
    limit: int
    holders: tuple[uuid.UUID, ...]
    holding: int
    ahead: int

    @property
    def admitted(self) -> bool:
        return self.holding < self.limit and self.ahead < self.limit - self.holding


def _same_key(task: Any) -> Any:
    return and_(
        Task.queue == task.queue, Task.name == task.name,
        Task.concurrency_key == task.concurrency_key, Task.concurrency_key.is_not(None),
    )


def read_key(connection: Connection, task: Any) -> KeyFacts | None:
    """The key facts of ``task`` (a row with its identity, key, limit, priority, ``run_at``),
    or None when it has no key or holds it already (asleep under scope ``workflow``)."""
    if task.concurrency_key is None or task.concurrency_held:
        return None
    limit = task.concurrency_limit
    if limit is None:
        limit = connection.execute(
            select(HandlerPolicy.concurrency_limit).where(
                HandlerPolicy.queue == task.queue, HandlerPolicy.name == task.name,
                HandlerPolicy.version == task.version,
            )
        ).scalar_one_or_none() or 1
    holding = (Task.state == literal_column("'running'")) | Task.concurrency_held
    holders = connection.execute(
        select(Task.id).where(_same_key(task), holding).order_by(Task.id)
    ).scalars().all()
    before = or_(
        Task.priority > task.priority,
        and_(Task.priority == task.priority, func.row(Task.run_at, Task.id)
             < func.row(task.run_at, task.id)),
    )
    ahead = connection.execute(
        select(func.count()).select_from(
            select(Task.id).where(
                _same_key(task), Task.state == literal_column("'pending'"),
                Task.concurrency_held.is_(False), Task.run_at <= NOW, before,
            ).limit(_AHEAD_MAX).subquery()
        )
    ).scalar_one()
    return KeyFacts(task.concurrency_key, int(limit), tuple(holders[:_NAMED]), len(holders),
                    int(ahead))


def key_reason(facts: Facts, key: KeyFacts | None) -> Reason | None:
    """``concurrency_key`` when the due task ``facts`` describes waits for its key."""
    if key is None or key.admitted or not facts.due:
        return None
    named = ", ".join(str(holder) for holder in key.holders)
    more = key.holding - len(key.holders)
    held = (
        f"held by task{'s' if key.holding > 1 else ''} {named}"
        + (f" and {more} more" if more > 0 else "")
        if key.holding else "held by no task"
    )
    behind = f"; {key.ahead} earlier task(s) of the key go first" if key.ahead else ""
    return Reason(
        "concurrency_key",
        f"waiting for concurrency key {key.key!r} ({held}, limit {key.limit}){behind}",
    )
