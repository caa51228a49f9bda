"""explain.reasons: the reasons a task is not running, in plain words, from the facts read
about it; pure, no I/O.

A terminal, running or waiting task has one reason: its state says it all. A pending task may
have several at once (not due yet, its queue paused, no live worker able to run it); the ones
that only matter at the moment of a claim (a rate limit's empty bucket, every able worker
busy) are given only for a task that is due now, since by its due time they will have
changed. A full queue (``queue_at_capacity``) refuses new tasks but never delays one it has
admitted: it is said, not counted as holding the task back. A pending task with nothing
holding it back is ``ready``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final, Literal, get_args

from sqlalchemy_pgtask.explain.facts import Facts, HandlerWorker, RateFacts, refill_time
from sqlalchemy_pgtask.models._durable import sleep_deadline
from sqlalchemy_pgtask.states import CANCELLED, FAILED, PENDING, RUNNING, WAITING, TaskState

__all__ = ["REASON_CODES", "Explanation", "Reason", "ReasonCode", "WorkerSlots", "reasons_of"]

#: Why a task is not running now (or, for ``running``, where it runs).
ReasonCode = Literal[
    "not_due", "sleeping", "queue_paused", "queue_at_capacity", "no_live_worker",
    "rate_limited", "workers_busy", "concurrency_key", "ready", "waiting_signal",
    "waiting_child", "waiting", "running", "terminal",
]
REASON_CODES: Final[tuple[ReasonCode, ...]] = get_args(ReasonCode)


@dataclass(frozen=True)
class WorkerSlots:
    """A live worker able to run the task, and how many of its slots are taken."""

    id: uuid.UUID
    running: int
    concurrency: int


@dataclass(frozen=True)
class Reason:
    """One reason the task is where it is: a stable ``code``, a sentence, and its details
    (None, or empty, where they do not apply to the code)."""

    code: ReasonCode
    #: One sentence in plain English, times in UTC.
    message: str
    #: Since when it holds: the queue paused, the wait registered, the attempt started, the
    #: task finished.
    since: datetime | None = None
    #: When it stops holding by itself: due time, wake time, bucket refill, wait timeout,
    #: lease expiry. Database time.
    until: datetime | None = None
    #: The durable call that sleeps or waits.
    step: str | None = None
    signal_name: str | None = None
    signal_occurrence: int | None = None
    child_id: uuid.UUID | None = None
    child_state: TaskState | None = None
    #: The worker running the task (``running``).
    worker_id: uuid.UUID | None = None
    #: ``no_live_worker``: the versions of the task's handler live workers have on its queue.
    live_versions: tuple[int, ...] = ()
    #: ``workers_busy``: every live worker able to run it, with its slots.
    workers: tuple[WorkerSlots, ...] = ()
    #: Who paused the queue or cancelled the task, and why, from the audit log.
    actor: str | None = None
    audit_reason: str | None = None
    #: ``terminal`` after a failure or cancellation: the stored error document.
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Explanation:
    """Why one task is not running now, read from the database alone at database time ``now``.

    ``str()`` gives the summary: a line naming the task, then one line per reason.
    """

    task_id: uuid.UUID
    queue: str
    name: str
    version: int
    state: TaskState
    #: Database time (``pgtask.now()``) of the reading; every reason's times compare to it.
    now: datetime
    reasons: tuple[Reason, ...]

    @property
    def codes(self) -> tuple[ReasonCode, ...]:
        """The reasons' codes, in order."""
        return tuple(reason.code for reason in self.reasons)

    def lines(self) -> list[str]:
        """The summary as lines: the task, then ``- <message>`` per reason."""
        head = f"task {self.task_id} ({self.name} v{self.version}, queue {self.queue}): "
        return [head + self.state, *(f"- {reason.message}" for reason in self.reasons)]

    @property
    def summary(self) -> str:
        """`lines` joined by newlines."""
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.summary


def when(value: datetime) -> str:
    """ISO 8601 in UTC to the millisecond, as the ``pgtask`` command prints times."""
    utc = value.astimezone(timezone.utc).replace(tzinfo=None)
    return utc.isoformat(timespec="milliseconds") + "Z"


def _span(seconds: float) -> str:
    whole = int(abs(seconds))
    if whole < 1:
        return "under a second"
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return " ".join(shown)


def _at(value: datetime, now: datetime) -> str:
    """``<time> (in 5m 3s)`` or ``<time> (2s ago)``, relative to database time."""
    delta = (value - now).total_seconds()
    relative = f"in {_span(delta)}" if delta > 0 else f"{_span(delta)} ago"
    return f"{when(value)} ({relative})"


def _error_text(error: dict[str, Any] | None) -> str:
    if not error:
        return "no error recorded"
    parts = [str(error.get("type", "error"))]
    parts += [str(error[key]) for key in ("exception", "message") if error.get(key)]
    return " ".join(": ".join(parts).split())


def _audit_text(actor: str | None, reason: str | None) -> str:
    text = "" if actor is None else f" by {actor}"
    return text + ("" if reason is None else f" ({' '.join(reason.split())})")


# -- finished, running, waiting ----------------------------------------------------------------


def _terminal(facts: Facts) -> Reason:
    task = facts.task
    finished = task.completed_at
    at = when(finished)
    if task.state == FAILED:
        budget = "" if task.max_attempts is None else f" of {task.max_attempts} allowed"
        message = (
            f"it failed at {at} after {task.failed_attempts} failed attempt(s){budget}: "
            f"{_error_text(task.error)}; it will not run again unless retried "
            f"(`pgtask task retry {task.id}`)"
        )
    elif task.state == CANCELLED:
        error = task.error or {}
        if error.get("reason") == "ancestor_finished":
            why = f" because its ancestor {error.get('ancestor_id')} finished first"
        elif error.get("reason") == "result_wait_timeout":
            why = (
                f" because task {error.get('waiter_id')} gave up waiting for it (a "
                "`wait_for_result` timeout cancels the child's whole subtree)"
            )
        else:
            why = _audit_text(facts.cancel_actor, facts.cancel_reason)
        message = (
            f"it was cancelled at {at}{why}; it will not run again unless retried "
            f"(`pgtask task retry {task.id}`)"
        )
    else:
        message = f"it succeeded at {at}; a finished task does not run again"
    return Reason(
        "terminal", message, since=finished, error=task.error, actor=facts.cancel_actor,
        audit_reason=facts.cancel_reason,
    )


def _running(facts: Facts) -> Reason:
    task, now, running = facts.task, facts.now, facts.running
    assert running is not None
    where = f"worker {task.lease_owner}"
    if running.hostname is not None:
        where += f" ({running.hostname}, pid {running.pid})"
    since = "" if running.started_at is None else f" since {when(running.started_at)}"
    parts = [f"it is running on {where}{since}, attempt {task.attempt}"]
    expired = task.lease_expires_at <= now
    if not expired:
        parts.append(f"its lease runs until {_at(task.lease_expires_at, now)}")
    else:
        parts.append(
            f"but its lease expired at {_at(task.lease_expires_at, now)}: the worker is gone "
            f"or stalled, and {_recovery(task)}"
        )
    if not running.worker_alive:
        parts.append("that worker has no live registration (no recent heartbeat)")
    if running.deadline_at is not None:
        parts.append(f"its time limit ends at {_at(running.deadline_at, now)}")
    if task.cancel_requested_at is not None and not expired:
        parts.append(
            f"cancellation was requested at {when(task.cancel_requested_at)}: the worker "
            "stops it and it ends cancelled"
        )
    return Reason(
        "running", "; ".join(parts), since=running.started_at, until=task.lease_expires_at,
        worker_id=task.lease_owner,
    )


def _recovery(task: Any) -> str:
    """What lease recovery does with a running task whose lease expired, as `RECOVER`
    (``statements.lease.recover_from``) decides it: the lost attempt counts as failed."""
    if task.cancel_requested_at is not None:
        requested = when(task.cancel_requested_at)
        return f"lease recovery will cancel the task (cancellation was requested at {requested})"
    if task.failed_attempts + 1 >= task.max_attempts:  # known once a task was claimed
        return (
            f"lease recovery will fail the task: the lost attempt {task.attempt} counts as "
            f"failed, and it has no attempt left of {task.max_attempts} allowed"
        )
    return "lease recovery will make the task pending again"


def _timeout(deadline: datetime | None, now: datetime) -> str:
    if deadline is None:
        return "with no timeout"
    if deadline <= now:  # the timeout pass skips a wait whose rows a transaction holds
        return (f"timed out at {_at(deadline, now)}, not yet applied (a transaction may hold "
                "this task, its child or a task below that child)")
    return f"until it times out at {_at(deadline, now)}"


def _waiting(facts: Facts) -> Reason:
    wait, now = facts.wait, facts.now
    if wait is None:
        # A consistent snapshot never shows this: the wait goes with the waiting state.
        return Reason("waiting", "it is waiting, but no wait is recorded for it")
    if wait.kind == "signal":
        message = (
            f"it is waiting for signal {wait.signal_name!r} (occurrence "
            f"{wait.signal_occurrence}) at step {wait.step!r} since {when(wait.since)}, "
            f"{_timeout(wait.timeout_at, now)}; emit_signal() delivers it"
        )
        return Reason(
            "waiting_signal", message, since=wait.since, until=wait.timeout_at,
            step=wait.step, signal_name=wait.signal_name,
            signal_occurrence=wait.signal_occurrence,
        )
    if wait.child_state is None:
        child = f"child task {wait.child_id} (no longer stored)"
    else:
        child = f"child task {wait.child_id} ({wait.child_name}, {wait.child_state})"
    message = (
        f"it is waiting for {child} to finish, at step {wait.step!r} since "
        f"{when(wait.since)}, {_timeout(wait.timeout_at, now)}"
    )
    return Reason(
        "waiting_child", message, since=wait.since, until=wait.timeout_at, step=wait.step,
        child_id=wait.child_id, child_state=wait.child_state,
    )


# -- pending -------------------------------------------------------------------------------------


def _schedule(facts: Facts) -> Reason:
    task, now = facts.task, facts.now
    latest = facts.latest_step
    if latest is not None:
        step, kind, value = latest
        if sleep_deadline(task.state, task.run_at, kind, value) is not None:
            return Reason(
                "sleeping",
                f"it is in a durable sleep at step {step!r} until {_at(task.run_at, now)}",
                until=task.run_at, step=step,
            )
    message = f"it is not due until {_at(task.run_at, now)}"
    if task.failed_attempts and task.error is not None:
        message += (
            f": a retry after failed attempt {task.failed_attempts} "
            f"({_error_text(task.error)})"
        )
    return Reason("not_due", message, until=task.run_at)


def _no_live_worker(facts: Facts, able: list[HandlerWorker]) -> Reason | None:
    task = facts.task
    if able:
        return None
    handler = f"handler {task.name!r} version {task.version} for queue {task.queue!r}"
    active = [w for w in facts.handlers if not w.draining]
    versions = tuple(sorted({w.version for w in active}))
    if facts.live_workers == 0:
        message = f"no worker is live; start one with {handler}"
    elif any(w.version == task.version for w in facts.handlers):
        message = f"only draining workers have {handler}; start a worker that has it"
    elif versions:
        listed = ", ".join(str(v) for v in versions)
        message = (
            f"no live worker has {handler}; live workers have version(s) {listed} of it"
        )
    elif facts.serving_workers == 0:
        message = f"no live worker serves queue {task.queue!r}; start one with {handler}"
    else:
        message = f"no live worker has {handler}; the workers serving the queue lack it"
    return Reason("no_live_worker", message, live_versions=versions)


def _rate_limited(facts: Facts, rate: RateFacts) -> Reason | None:
    task, now = facts.task, facts.now
    shown = f"{rate.limit} per {rate.period_seconds:g}s"
    if not rate.readable:
        return Reason(
            "rate_limited",
            f"queue {task.queue!r} is rate limited to {shown}; this database role cannot "
            "read pgtask.rate_buckets to say whether a start is allowed now",
        )
    until = refill_time(rate, now)
    if until is None:
        return None
    return Reason(
        "rate_limited",
        f"queue {task.queue!r} is rate limited to {shown} and has no start left until "
        f"{_at(until, now)}",
        until=until,
    )


def _busy(able: list[HandlerWorker]) -> Reason | None:
    if not able or any(w.running < w.concurrency for w in able):
        return None
    slots = tuple(WorkerSlots(w.id, w.running, w.concurrency) for w in able)
    listed = ", ".join(f"{w.id} runs {w.running} of {w.concurrency}" for w in slots)
    return Reason(
        "workers_busy",
        f"every live worker able to run it is busy ({listed}); it starts when a slot frees",
        workers=slots,
    )


def _pending(facts: Facts) -> tuple[Reason, ...]:
    task = facts.task
    reasons: list[Reason] = []
    if not facts.due:
        reasons.append(_schedule(facts))
    if facts.pause is not None:
        pause = facts.pause
        reasons.append(Reason(
            "queue_paused",
            f"queue {task.queue!r} is paused since {when(pause.paused_at)}"
            f"{_audit_text(pause.actor, pause.reason)}; workers claim nothing from it until "
            f"it is resumed (`pgtask queue resume {task.queue}`)",
            since=pause.paused_at, actor=pause.actor, audit_reason=pause.reason,
        ))
    if facts.capacity is not None and facts.capacity[0] >= facts.capacity[1]:
        outstanding, limit = facts.capacity
        reasons.append(Reason(
            "queue_at_capacity",
            f"queue {task.queue!r} is at its capacity ({outstanding} of {limit} outstanding "
            "tasks): it refuses new tasks and retries (PT001) until some finish; this task "
            "is admitted already, so the capacity does not delay it",
        ))
    able = [w for w in facts.handlers if not w.draining and w.version == task.version]
    missing = _no_live_worker(facts, able)
    if missing is not None:
        reasons.append(missing)
    if facts.due and facts.pause is None:
        limited = None if facts.rate is None else _rate_limited(facts, facts.rate)
        busy = _busy(able)
        reasons += [r for r in (limited, busy) if r is not None]
    if all(reason.code == "queue_at_capacity" for reason in reasons):
        reasons.append(Reason(
            "ready",
            f"it is due since {when(task.run_at)} and nothing holds it back: "
            f"{len(able)} live worker(s) can run it, and the next claim takes it (after any "
            "due task of its queue with a higher priority or an earlier due time)",
            since=task.run_at,
        ))
    return tuple(reasons)


def reasons_of(facts: Facts) -> tuple[Reason, ...]:
    """Why the task of ``facts`` is not running now; for a running task, where it runs."""
    state = facts.task.state
    if state == PENDING:
        return _pending(facts)
    if state == WAITING:
        return (_waiting(facts),)
    if state == RUNNING:
        return (_running(facts),)
    return (_terminal(facts),)
