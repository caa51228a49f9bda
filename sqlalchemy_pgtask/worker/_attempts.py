"""worker._attempts: the attempts a worker holds, from claim until their outcome is written.

The book is the one piece of state the producer, executor, completer and lease keeper share.
An attempt occupies a *slot* while its handler runs (at most ``concurrency``), and stays
*active* until its outcome is written (so its lease keeps being renewed); while ``backlog``
finished attempts (``concurrency + prefetch``) wait for the writer, no handler starts: the
claim loop's back-pressure on a slow database. A row claimed ahead that is handed back
without running is active, holding no slot, until its release is written.

`Observer` is the hooks the loops report to (`NO_OBSERVER` does nothing); `_observer` has the
one that traces and counts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy_pgtask.durable.context import BaseTaskContext
from sqlalchemy_pgtask.registry import TaskDefinition
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements import Lease

if TYPE_CHECKING:
    from sqlalchemy_pgtask.outcome import Outcome

__all__ = ["NO_OBSERVER", "ActiveAttempt", "AttemptBook", "Observer"]


@dataclass(eq=False)
class ActiveAttempt:
    """One claimed attempt."""

    ctx: BaseTaskContext
    definition: TaskDefinition[Any, Any]
    payload: Any
    lease: Lease
    policy: RetryPolicy
    #: Monotonic time the last claim or renewal that extended this lease was *sent*: the
    #: database's expiry is at least this plus the lease duration.
    lease_sent_at: float
    started_at: float = field(default_factory=time.monotonic)
    handle: asyncio.Task[None] | None = None
    #: The handler has finished (its outcome is queued or written): it holds no slot.
    settled: bool = False
    #: The worker cancelled the handler's coroutine itself.
    stopped_by_worker: bool = False
    #: A durable call suspended the task (sleep, wait): the lease is already released and
    #: nothing is written for this attempt.
    suspended: bool = False
    #: Stops the handler when its time limit runs out (cancelled once it settles).
    timer: asyncio.TimerHandle | None = None

    @property
    def task_id(self) -> uuid.UUID:
        return self.lease.task_id


class AttemptBook:
    """Active attempts by task id, the slots in use, and the events that announce changes."""

    def __init__(self, concurrency: int, changed: asyncio.Event, *, backlog: int) -> None:
        self.concurrency = concurrency
        #: Most finished attempts that may wait for their outcome to be written.
        self.backlog = backlog
        self.active: dict[uuid.UUID, ActiveAttempt] = {}
        #: Attempts whose handler has not finished: the slots in use.
        self.unsettled = 0
        #: Set whenever a slot or an active entry frees up (the claim loop's wake-up event:
        #: one event, so a full worker waits on one future per freed slot).
        self.changed = changed
        #: Told what the loops sharing this book do, for traces and metrics.
        self.observer: Observer = NO_OBSERVER
        #: Told the monotonic time of each handler's end.
        self.on_settle: Callable[[float], None] | None = None

    def free_slots(self) -> int:
        return min(
            self.concurrency - self.unsettled,
            self.concurrency + self.backlog - len(self.active),
        )

    def writer_behind(self) -> bool:
        """The backlog of outcomes to write, not the handlers, holds back what may start."""
        return len(self.active) - self.unsettled >= self.backlog

    def add(self, attempt: ActiveAttempt) -> None:
        self.active[attempt.task_id] = attempt
        self.unsettled += 1

    def hold(self, attempt: ActiveAttempt) -> None:
        """Renew the lease of a settled attempt that never ran (a hand-back of a row claimed
        ahead) until its outcome is written."""
        attempt.settled = True
        self.active[attempt.task_id] = attempt

    def settle(self, attempt: ActiveAttempt) -> None:
        """The handler finished: its slot is free; its outcome still has to be written."""
        if not attempt.settled:
            attempt.settled = True
            self.unsettled -= 1
            self.changed.set()
            if self.on_settle is not None:
                self.on_settle(time.monotonic())
            if attempt.timer is not None:
                attempt.timer.cancel()

    def forget(self, attempt: ActiveAttempt) -> None:
        """The outcome is written (or cannot be): stop renewing the lease."""
        self.settle(attempt)
        if self.active.get(attempt.task_id) is attempt:
            del self.active[attempt.task_id]
            self.changed.set()

    def stop_renewing(self, attempt: ActiveAttempt) -> None:
        """The lease was released by a suspension: stop renewing it; the slot stays taken
        until the handler has unwound (`settle`)."""
        if self.active.get(attempt.task_id) is attempt:
            del self.active[attempt.task_id]
            self.changed.set()

    def holds(self, lease: Lease) -> bool:
        attempt = self.active.get(lease.task_id)
        return attempt is not None and attempt.lease == lease

    def running(self) -> list[ActiveAttempt]:
        """Attempts whose handler still runs."""
        return [a for a in self.active.values() if not a.settled]


class Observer:
    """The hooks; this base does nothing (`NO_OBSERVER`)."""

    def attempt_started(self, attempt: ActiveAttempt) -> None:
        """A handler is about to run (called in the attempt's own asyncio task)."""

    def attempt_finished(
        self, attempt: ActiveAttempt, outcome: Outcome | None, raised: BaseException | None
    ) -> None:
        """The handler ended and ``outcome`` was decided (same task as `attempt_started`)."""

    def outcome_written(self, attempt: ActiveAttempt, outcome: Outcome, state: str) -> None:
        """The writer stored ``outcome``; the task is now in ``state``."""

    def outcome_lost(self, attempt: ActiveAttempt, outcome: Outcome) -> None:
        """``outcome`` was not written: the attempt's lease was gone by then."""

    def outcome_given_up(self, attempt: ActiveAttempt, outcome: Outcome, reason: str) -> None:
        """The writer gave ``outcome`` up after tries cut short (``reason``: the last one's
        ``lock_not_available`` or ``statement_timeout``); its lease is left to expire."""

    def claimed(self, count: int) -> None:
        """A claim statement took ``count`` tasks."""

    def leases_renewed(self, count: int) -> None:
        """A renewal extended ``count`` leases."""

    def lease_lost(self, reason: str) -> None:
        """A handler was stopped for its lease (``lost`` or ``expiring``)."""

    def connected(self, owner: object) -> None:
        """``owner`` (a held connection, the listener) has a connection; again after a loss."""

    async def start(self) -> None:
        """Before the worker starts: open the probe server."""

    async def stop(self) -> None:
        """When the worker has stopped: close it."""


NO_OBSERVER: Final = Observer()
