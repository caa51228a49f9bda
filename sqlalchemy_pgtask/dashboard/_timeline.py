"""dashboard._timeline: a task's workflow on one time axis, for the task page; never writes.

Attempts, checkpoints (steps), waits (sleeps, signals, children) and children become shapes
placed on a shared axis, and each attempt gets a sentence saying why it ended. The geometry
is computed here, so the template only writes numbers into SVG attributes: no script and no
inline style, as the dashboard's Content-Security-Policy requires. Everything shown comes from
a bounded `status.task_detail` (the newest `TIMELINE_LIMIT` attempts, steps and children) plus
three statements of at most `TIMELINE_LIMIT` rows, so a workflow of 100,000 steps costs a page
the same as a short one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Connection, func, select

from sqlalchemy_pgtask.models import Signal, Task
from sqlalchemy_pgtask.status import AttemptInfo, StepInfo, TaskDetail

__all__ = ["TIMELINE_LIMIT", "Ending", "Mark", "Timeline", "timeline"]

#: The most attempts, steps and children the task page reads and draws (the newest ones).
TIMELINE_LIMIT: Final = 100

#: The drawing's coordinates (SVG user units): lane labels left of ``_LEFT``.
_LEFT: Final = 110.0
_RIGHT: Final = 960.0
_LANE: Final = 28.0
_TOP: Final = 8.0
#: The narrowest bar drawn, so an attempt of a millisecond still shows.
_MIN_WIDTH: Final = 2.0
LANES: Final = ("Attempts", "Steps", "Waits", "Children")


@dataclass(frozen=True)
class Mark:
    """One shape: a bar from ``x`` over ``width`` (a point when ``width`` is 0) in a lane."""

    lane: int
    x: float
    width: float
    #: Its classes in dashboard.css, e.g. ``tl-attempt tl-failed``.
    css: str
    #: Its tooltip (an SVG ``<title>``): user data, escaped by the template.
    title: str
    child_id: uuid.UUID | None = None

    @property
    def y(self) -> float:
        return _TOP + self.lane * _LANE + 6.0


@dataclass(frozen=True)
class Ending:
    """Why one attempt ended, in a sentence (user data: escaped by the template)."""

    attempt: int
    state: str
    text: str
    child_id: uuid.UUID | None = None
    #: What a suspended attempt waited for: ``sleep``, ``signal`` or ``child``.
    waited: str | None = None


@dataclass(frozen=True)
class Timeline:
    start: datetime
    end: datetime
    marks: tuple[Mark, ...]
    #: ``(x, label)`` of the axis' ticks.
    ticks: tuple[tuple[float, str], ...]
    endings: tuple[Ending, ...]
    attempts_omitted: int
    steps_omitted: int
    children_omitted: int
    lanes: tuple[tuple[float, str], ...] = tuple(
        (_TOP + index * _LANE + 17.0, name) for index, name in enumerate(LANES)
    )
    left: float = _LEFT
    right: float = _RIGHT
    axis_y: float = _TOP + len(LANES) * _LANE + 4.0
    height: float = _TOP + len(LANES) * _LANE + 24.0


@dataclass(frozen=True)
class _Child:
    id: uuid.UUID
    name: str
    state: str
    created_at: datetime
    completed_at: datetime | None


def _children(connection: Connection, task_id: uuid.UUID) -> list[_Child]:
    """The newest children with their times, served by ``ix_tasks_parent``."""
    rows = connection.execute(
        select(Task.id, Task.name, Task.state, Task.created_at, Task.completed_at)
        .where(Task.parent_id == task_id)
        .order_by(Task.created_at.desc(), Task.id.desc())
        .limit(TIMELINE_LIMIT)
    )
    return [_Child(r.id, r.name, r.state, r.created_at, r.completed_at) for r in rows][::-1]


def _signal_names(
    connection: Connection, task_id: uuid.UUID, steps: Sequence[StepInfo]
) -> dict[datetime, str]:
    """The name of the signal that resolved each signal checkpoint shown: a signal sent to a
    waiting task is checkpointed in the sending transaction, so both share its instant.

    The observer level may not read ``pgtask.signals`` (their values are the emitters'): the
    privilege is checked first, and without it the names stay unknown ("a signal")."""
    instants = [s.created_at for s in steps if s.kind == "signal"]
    if not instants or not connection.scalar(
        select(func.has_table_privilege("pgtask.signals", "SELECT"))
    ):
        return {}
    rows = connection.execute(
        select(Signal.created_at, Signal.name)
        .where(Signal.task_id == task_id, Signal.created_at.in_(instants))
        .limit(TIMELINE_LIMIT)
    )
    return {r.created_at: r.name for r in rows}


def _stamp(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _wake(step: StepInfo) -> datetime | None:
    raw = step.value.get("wake_at") if isinstance(step.value, dict) else None
    try:
        return datetime.fromisoformat(raw) if isinstance(raw, str) else None
    except ValueError:
        return None


def _error_text(error: dict[str, Any] | None) -> str:
    if not error:
        return "no error recorded"
    kind = error.get("exception") or error.get("type") or "error"
    message = error.get("message")
    return f"{kind}: {message}" if message else str(kind)


class _Reader:
    """Tells why each attempt ended from the task's attempts, steps, wait and children."""

    def __init__(
        self, task: TaskDetail, children: Sequence[_Child], signals: dict[datetime, str]
    ) -> None:
        self.task = task
        self.steps = sorted(task.steps, key=lambda s: s.created_at)
        self.ended = {c.completed_at: c for c in children if c.completed_at is not None}
        self.signals = signals

    def suspended(self, attempt: AttemptInfo, following: AttemptInfo | None) -> Ending:
        end = attempt.finished_at or attempt.started_at
        within = [s for s in self.steps if attempt.started_at <= s.created_at <= end]
        if within and within[-1].kind == "sleep":
            nap = within[-1]
            wake = _wake(nap)
            until = f" until {_stamp(wake)}" if wake else ""
            return self._ending(attempt, f"for a sleep at step {nap.step} #{nap.occurrence}"
                                f"{until}", waited="sleep")
        wait = self.task.wait
        if following is None and wait is not None and wait.kind != "sleep":
            if wait.signal_name is not None:
                return self._ending(attempt, f"waiting for signal {wait.signal_name} at "
                                    f"step {wait.step} #{wait.occurrence}", waited="signal")
            return self._ending(
                attempt, f"waiting for child {wait.child_id} at step {wait.step} "
                f"#{wait.occurrence}", wait.child_id, "child",
            )
        limit = following.started_at if following is not None else None
        for step in self.steps:
            if step.created_at < end or (limit is not None and step.created_at > limit):
                continue
            if step.kind == "signal":
                return self._signal(attempt, step)
            if step.kind == "result":
                child = self.ended.get(step.created_at)
                if child is None:
                    return self._ending(attempt, f"waited for a child at step "
                                        f"{step.step}, resolved at {_stamp(step.created_at)}",
                                        waited="child")
                return self._ending(
                    attempt, f"waited for child {child.id} at step {step.step}, "
                    f"which ended {child.state} at {_stamp(step.created_at)}", child.id, "child",
                )
        return self._ending(attempt, "what for is older than the steps shown")

    def _signal(self, attempt: AttemptInfo, step: StepInfo) -> Ending:
        at = _stamp(step.created_at)
        if isinstance(step.value, dict) and step.value.get("timeout"):
            return self._ending(attempt, f"waited for a signal at step {step.step}, "
                                f"timed out at {at}", waited="signal")
        name = self.signals.get(step.created_at)
        what = f"signal {name}" if name else "a signal"
        return self._ending(attempt, f"waited for {what} at step {step.step}, "
                            f"received at {at}", waited="signal")

    @staticmethod
    def _ending(
        attempt: AttemptInfo, text: str, child: uuid.UUID | None = None,
        waited: str | None = None,
    ) -> Ending:
        return Ending(attempt.attempt, attempt.state, text, child, waited)

    def ending(self, attempt: AttemptInfo, following: AttemptInfo | None) -> Ending:
        state = attempt.state
        if state == "suspended":
            return self.suspended(attempt, following)
        if state == "running":
            lease = self.task.lease_expires_at
            text = f"lease until {_stamp(lease)}" if lease else "no lease"
        elif state == "failed":
            text = f"with {_error_text(attempt.error)}"
        elif state == "lost":
            text = "lease expired: its worker stopped renewing it; another attempt may run"
            if attempt.error and attempt.error.get("type") != "lease_expired":
                text = f"lease lost: {_error_text(attempt.error)}"
        elif state == "released":
            text = "handed back to the queue (its worker stopped or released it)"
        else:
            text = ""
        return self._ending(attempt, text)


class _Axis:
    def __init__(self, start: datetime, end: datetime) -> None:
        self.start = start
        self.span = max((end - start).total_seconds(), 1e-3)

    def x(self, value: datetime) -> float:
        share = (value - self.start).total_seconds() / self.span
        return round(_LEFT + min(max(share, 0.0), 1.0) * (_RIGHT - _LEFT), 2)

    def bar(self, lane: int, start: datetime, end: datetime, css: str, title: str,
            child: uuid.UUID | None = None) -> Mark:
        x = self.x(start)
        width = max(self.x(end) - x, _MIN_WIDTH)
        return Mark(lane, min(x, _RIGHT - _MIN_WIDTH), width, css, title, child)

    def ticks(self, count: int = 5) -> tuple[tuple[float, str], ...]:
        shape = "%H:%M:%S" if self.span < 86_400 else "%m-%d %H:%M"
        # Under a minute, seconds alone repeat from tick to tick: show milliseconds too.
        cut = -3 if self.span < 60 else None
        if cut is not None:
            shape += ".%f"
        step = timedelta(seconds=self.span / count)
        start = self.start.astimezone(timezone.utc)
        return tuple(
            (self.x(start + step * n), (start + step * n).strftime(shape)[:cut])
            for n in range(count + 1)
        )


def _steps(axis: _Axis, steps: Iterable[StepInfo]) -> list[Mark]:
    marks = []
    for step in steps:
        title = f"{step.kind} {step.step} #{step.occurrence} at {_stamp(step.created_at)}"
        marks.append(Mark(1, axis.x(step.created_at), 0.0, f"tl-step tl-kind-{step.kind}",
                          title))
        wake = _wake(step) if step.kind == "sleep" else None
        if wake is not None:
            marks.append(axis.bar(2, step.created_at, wake, "tl-wait tl-sleep",
                                  f"sleep {step.step} until {_stamp(wake)}"))
    return marks


def timeline(connection: Connection, task: TaskDetail, now: datetime) -> Timeline:
    """The timeline of ``task`` (read with ``*_limit=TIMELINE_LIMIT``) at database time
    ``now``; three more statements at most, of at most `TIMELINE_LIMIT` rows each."""
    children = _children(connection, task.id)
    reader = _Reader(task, children, _signal_names(connection, task.id, task.steps))
    shown = [*(a.started_at for a in task.attempts), *(s.created_at for s in task.steps),
             *(c.created_at for c in children)]
    # With older parts left out, the axis starts at the oldest part shown: from the task's
    # creation, days of history would squeeze the newest 100 steps into a sliver.
    cut = task.attempts_omitted or task.steps_omitted or task.children_omitted
    instants = shown if cut and shown else [task.created_at, *shown]
    ends = [*(a.finished_at for a in task.attempts), *(_wake(s) for s in task.steps),
            *(c.completed_at for c in children), task.completed_at]
    last = max([*instants, *(e for e in ends if e is not None)])
    end = last if task.completed_at is not None else max(last, now)
    axis = _Axis(min(instants), end)
    marks: list[Mark] = []
    endings: list[Ending] = []
    for index, attempt in enumerate(task.attempts):
        following = task.attempts[index + 1] if index + 1 < len(task.attempts) else None
        ending = reader.ending(attempt, following)
        endings.append(ending)
        marks.append(axis.bar(0, attempt.started_at, attempt.finished_at or end,
                              f"tl-attempt tl-{attempt.state}",
                              f"attempt {attempt.attempt} {attempt.state}: {ending.text}"))
        if ending.waited in ("signal", "child") and attempt.finished_at is not None:
            resumed = following.started_at if following is not None else end
            marks.append(axis.bar(2, attempt.finished_at, resumed,
                                  f"tl-wait tl-wait-{ending.waited}", ending.text))
    marks.extend(_steps(axis, task.steps))
    for child in children:
        marks.append(axis.bar(3, child.created_at, child.completed_at or end,
                              f"tl-child tl-{child.state}",
                              f"child {child.name} {child.state}", child.id))
    return Timeline(
        start=axis.start, end=end, marks=tuple(marks), ticks=axis.ticks(),
        endings=tuple(endings), attempts_omitted=task.attempts_omitted,
        steps_omitted=task.steps_omitted,
        children_omitted=task.children_omitted,
    )
