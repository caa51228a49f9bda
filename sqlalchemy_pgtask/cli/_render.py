"""Text and JSON renderings of the read models in `sqlalchemy_pgtask.status`; pure, no I/O.

Each function returns the lines a command prints. Times are shown in UTC (ISO 8601, to the
millisecond, with a ``Z``), whatever the session's time zone, so two operators' outputs
compare. JSON documents (``task show --json``) keep full precision: ISO 8601 with the offset,
UUIDs as strings.

Most of what is printed is user data (payloads, errors and tracebacks, idempotency keys,
audit actors and reasons, schedule errors, host names) and may hold terminal control
sequences; a command passes every line through `printable` before it reaches the terminal.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, Final

from sqlalchemy_pgtask._logging import escape_controls as printable
from sqlalchemy_pgtask.audit import AuditRecord
from sqlalchemy_pgtask.status import (
    AttemptInfo,
    HeldBack,
    QueueSettings,
    QueueStatus,
    StepInfo,
    TaskDetail,
    TaskRef,
    TaskSummary,
    Unroutable,
    WaitInfo,
    WorkerInfo,
)

__all__ = [
    "audit_json",
    "audit_lines",
    "json_default",
    "printable",
    "queue_settings_line",
    "rate",
    "status_lines",
    "task_detail_json",
    "task_detail_lines",
    "task_list_lines",
]

_INDENT: Final = "  "
#: Error-document keys rendered by `_error_lines` itself; the rest are listed after them.
_ERROR_KEYS: Final = frozenset({"type", "exception", "message", "traceback"})
#: `TaskDetail` fields shown as sections of their own, not as the task's fields (the
#: ``*_omitted`` counts, always 0 here: the command reads every attempt, step and child).
_RELATED: Final = ("attempts", "steps", "wait", "children", "parent", "concurrency_holders",
                   "attempts_omitted", "steps_omitted", "children_omitted")
#: A step's value longer than this (as JSON) is cut in the text output; ``--json`` has it all.
_STEP_VALUE_WIDTH: Final = 120


def when(value: datetime | None) -> str:
    """A timestamp as ISO 8601 in UTC to the millisecond (``2024-05-01T12:00:00.123Z``)."""
    if value is None:
        return "-"
    utc = value.astimezone(timezone.utc).replace(tzinfo=None)
    return utc.isoformat(timespec="milliseconds") + "Z"


def _indented(lines: Iterable[str], depth: int) -> list[str]:
    return [f"{_INDENT * depth}{line}" for line in lines]


def status_lines(
    workers: Sequence[WorkerInfo], queues: Sequence[QueueStatus], stuck: Sequence[Unroutable],
    held: Sequence[HeldBack] = (),
) -> list[str]:
    """``pgtask status``: live workers, every queue, pending work no live worker can run, and
    work background passes have held back (`status.held_back`)."""
    out = [f"live workers: {len(workers)}"]
    for w in workers:
        flag = " (draining)" if w.draining else ""
        if w.heartbeat_stopped:
            left = max(0.0, w.ttl_seconds - w.heartbeat_age_seconds)
            beat = f"heartbeat stopped {w.heartbeat_age_seconds:.1f}s ago (expires in {left:.1f}s)"
        else:
            beat = f"heartbeat {w.heartbeat_age_seconds:.1f}s ago"
        out.append(
            f"  {w.id}  {w.hostname} pid {w.pid}  queues {','.join(w.queues)}  "
            f"concurrency {w.concurrency}  {beat}{flag}"
        )
    out.append("queues:" if queues else "queues: none has settings or tasks")
    for q in queues:
        out.append(
            f"  {q.name}: {q.pending} pending ({q.due} due), {q.running} running, "
            f"{q.waiting} waiting"
        )
        if q.max_outstanding_tasks is None:
            capacity = "capacity unlimited"
        else:
            capacity = f"capacity {q.outstanding_tasks}/{q.max_outstanding_tasks} used"
        paused = f"paused since {when(q.paused_at)}" if q.paused else "not paused"
        out.append(
            f"    finished: {q.succeeded} succeeded, {q.failed} failed, {q.cancelled} cancelled;"
            f" {capacity}; {paused}"
        )
    if stuck:
        out.append("pending tasks no live worker can run:")
        out += [f"  {u.queue} {u.name} v{u.version}: {u.count}" for u in stuck]
    out += [f"held back: {h.message}" for h in held]
    return out


_LIST_HEADER: Final = ("ID", "QUEUE", "TASK", "STATE", "ATTEMPT", "CREATED", "UPDATED")


def task_list_lines(tasks: Sequence[TaskSummary], limit: int) -> list[str]:
    """``pgtask task list``: a header and one aligned line per task, newest first."""
    if not tasks:
        return ["no tasks match"]
    rows = [_LIST_HEADER] + [
        (
            str(t.id), t.queue, f"{t.name} v{t.version}", t.state,
            f"{t.attempt}/{t.max_attempts or 'default'}", when(t.created_at),
            when(t.updated_at),
        )
        for t in tasks
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_LIST_HEADER))]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if len(tasks) == limit:
        out.append(f"(first {limit}; older ones: add --before {tasks[-1].id})")
    return out


def _json_lines(value: Any) -> list[str]:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True).splitlines()


def _document(name: str, value: Any) -> list[str]:
    """``name: <JSON>``; a document that spans lines goes below its name, indented."""
    lines = _json_lines(value)
    if len(lines) > 1:
        return [f"{name}:", *_indented(lines, 1)]
    return [f"{name}: {lines[0]}"]


def _field(name: str, value: Any) -> list[str]:
    """``name: value``, with ``-`` for a missing value; dicts and lists as JSON."""
    if isinstance(value, (dict, list)):
        return _document(name, value)
    if value is None:
        value = "-"
    elif isinstance(value, datetime):
        value = when(value)
    return [f"{name}: {value}"]


def _error_summary(error: dict[str, Any]) -> str:
    """``kind: Exception: message``, the parts the document has."""
    parts = [str(error.get("type", "error"))]
    parts += [str(error[key]) for key in ("exception", "message") if error.get(key)]
    return ": ".join(parts)


def _error_lines(error: dict[str, Any] | None) -> list[str]:
    if error is None:
        return ["error: -"]
    out = [f"error: {_one_line(_error_summary(error))}"]
    extra = {k: v for k, v in error.items() if k not in _ERROR_KEYS}
    for key in sorted(extra):
        out += _indented(_field(key, extra[key]), 1)
    traceback = error.get("traceback")
    if traceback:
        out += _indented(str(traceback).rstrip("\n").splitlines(), 1)
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _retry(task: TaskDetail) -> str:
    if task.retry_kind is None:
        return "-"
    parts = [task.retry_kind]
    if task.retry_base_seconds is not None:
        parts.append(f"base {task.retry_base_seconds:g}s")
    if task.retry_factor is not None:
        parts.append(f"factor {task.retry_factor:g}")
    if task.retry_max_seconds is not None:
        parts.append(f"max {task.retry_max_seconds:g}s")
    if task.retry_jitter:
        parts.append("jitter")
    return ", ".join(parts)


def _attempt_lines(attempt: AttemptInfo) -> list[str]:
    took = ""
    if attempt.finished_at is not None:
        took = f" ({(attempt.finished_at - attempt.started_at).total_seconds():.3f}s)"
    worker = attempt.worker_id if attempt.worker_id is not None else "-"
    out = [
        f"attempt {attempt.attempt}: {attempt.state} by worker {worker}, "
        f"started {when(attempt.started_at)}, finished {when(attempt.finished_at)}{took}"
    ]
    if attempt.error is not None:
        out.append(f"{_INDENT}{_one_line(_error_summary(attempt.error))}")
    return out


def _ref(task: TaskRef) -> str:
    return f"{task.id}  {task.name} v{task.version}  {task.state}"


def _parent(task: TaskDetail) -> str | None:
    if task.parent is not None:
        return _ref(task.parent)
    # A parent deleted between the two reads of a READ COMMITTED caller: its id is known.
    return None if task.parent_id is None else str(task.parent_id)


def _wait(wait: WaitInfo | None) -> str | None:
    if wait is None:
        return None
    step = f"step {wait.step!r} #{wait.occurrence}"
    if wait.kind == "signal":
        what = f"signal {wait.signal_name} #{wait.signal_occurrence} ({step})"
    elif wait.kind == "child":
        what = f"child {wait.child_id} ({step})"
    else:
        what = f"sleep ({step})"
    if wait.deadline is None:
        until = "no timeout"
    else:
        until = f"{'wakes' if wait.kind == 'sleep' else 'times out'} {when(wait.deadline)}"
    return f"{what}, since {when(wait.since)}, {until}"


def _step_line(step: StepInfo, version: int) -> str:
    value = json.dumps(step.value, ensure_ascii=False, sort_keys=True)
    if len(value) > _STEP_VALUE_WIDTH:
        value = f"{value[:_STEP_VALUE_WIDTH]}... ({len(value)} characters; --json has all)"
    # The task's own version goes without saying; another one (kept from an older handler)
    # must show, or two steps of the same name would look like one replayed twice.
    other = "" if step.version == version else f" (v{step.version})"
    key = f"{step.step!r} #{step.occurrence}{other}"
    return f"{key}: {step.kind} at {when(step.created_at)}: {value}"


def _durable_sections(task: TaskDetail) -> list[str]:
    """``children:`` and ``steps:``, each only when the task has some."""
    out: list[str] = []
    if task.children:
        out += ["children:", *_indented((_ref(child) for child in task.children), 1)]
    if task.steps:
        out.append("steps:")
        out += _indented((_step_line(step, task.version) for step in task.steps), 1)
    return out


def _key(task: TaskDetail) -> str | None:
    holders = ", ".join(map(str, task.concurrency_holders)) or "nobody"
    limit = task.concurrency_limit or "the handler's"
    return task.concurrency_key and f"{task.concurrency_key!r} (limit {limit}; held by {holders})"


def task_detail_lines(task: TaskDetail) -> list[str]:
    """``pgtask task show``: the task's fields (its wait and parent among them), its
    documents, its error, then its children, its steps and each attempt."""
    scalars: list[tuple[str, Any]] = [
        ("queue", task.queue), ("name", task.name), ("version", task.version),
        ("state", task.state), ("wait", _wait(task.wait)), ("priority", task.priority),
        ("run_at", task.run_at), ("attempt", task.attempt),
        ("failed_attempts", task.failed_attempts),
        ("max_attempts", task.max_attempts or "the handler's (set at the first claim)"),
        ("retry", _retry(task)), ("idempotency_key", task.idempotency_key),
        ("parent", _parent(task)), ("concurrency_key", _key(task)),
        ("lease_owner", task.lease_owner), ("lease_expires_at", task.lease_expires_at),
        ("cancel_requested_at", task.cancel_requested_at), ("created_at", task.created_at),
        ("updated_at", task.updated_at), ("completed_at", task.completed_at),
    ]
    body: list[str] = []
    for name, value in scalars:
        body += _field(name, value)
    for name, document in (
        ("headers", task.headers), ("payload", task.payload), ("result", task.result)
    ):
        body += _document(name, document)
    body += _error_lines(task.error)
    out = [f"task {task.id}", *_indented(body, 1), *_durable_sections(task)]
    if not task.attempts:
        return [*out, "attempts: none"]
    out.append("attempts:")
    for attempt in task.attempts:
        out += _indented(_attempt_lines(attempt), 1)
    return out


def json_default(value: object) -> Any:
    """``json.dumps``'s ``default`` for the CLI's documents: times in ISO 8601, ids as text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def task_detail_json(task: TaskDetail) -> str:
    """``pgtask task show --json``: ``{"task": {...}, "attempts": [...], "steps": [...],
    "wait": {...} or null, "children": [...], "parent": {...} or null}`` on one line."""
    fields = {
        f.name: getattr(task, f.name) for f in dataclasses.fields(task) if f.name not in _RELATED
    }
    document = {
        "task": {**fields, "concurrency_holders": list(task.concurrency_holders)},
        "attempts": [dataclasses.asdict(attempt) for attempt in task.attempts],
        "steps": [dataclasses.asdict(step) for step in task.steps],
        "wait": None if task.wait is None else dataclasses.asdict(task.wait),
        "children": [dataclasses.asdict(child) for child in task.children],
        "parent": None if task.parent is None else dataclasses.asdict(task.parent),
    }
    return json.dumps(document, default=json_default, ensure_ascii=False)


#: Rate periods with a name of their own: ``100/m`` rather than ``100/60s``.
_PERIODS: Final = {1.0: "s", 60.0: "m", 3600.0: "h", 86400.0: "d"}


def rate(limit: int | None, period_seconds: float | None) -> str:
    """A rate limit as ``pgtask queue set --rate-limit`` takes it (``100/s``, ``5/30s``)."""
    if limit is None or period_seconds is None:
        return "unlimited"
    unit = _PERIODS.get(period_seconds)
    return f"{limit}/{unit}" if unit else f"{limit}/{period_seconds:g}s"


def queue_settings_line(queue: QueueSettings) -> str:
    """One queue's settings (``pgtask queue list``, ``set``, ``pause`` and ``resume``)."""
    if queue.max_outstanding_tasks is None:
        capacity = "unlimited"
    else:
        capacity = f"{queue.outstanding_tasks}/{queue.max_outstanding_tasks}"
    paused = f"paused since {when(queue.paused_at)}" if queue.paused_at else "active"
    starvation = queue.starvation_timeout_seconds
    return (
        f"{queue.name}: {paused}, capacity {capacity}, terminal retention "
        f"{queue.terminal_retention_seconds}s, idempotency retention "
        f"{queue.idempotency_retention_seconds}s, rate "
        f"{rate(queue.rate_limit, queue.rate_period_seconds)}, starvation timeout "
        f"{'none' if starvation is None else f'{starvation:g}s'}"
    )


_AUDIT_HEADER: Final = ("ID", "TIME", "ACTOR", "ACTION", "TARGET", "REASON", "DETAILS")


def _target(entry: AuditRecord) -> str:
    names = [
        f"{kind} {value}"
        for kind, value in (
            ("task", entry.task_id), ("queue", entry.queue), ("schedule", entry.schedule)
        )
        if value is not None
    ]
    return ", ".join(names) or "-"


def audit_lines(entries: Sequence[AuditRecord], limit: int) -> list[str]:
    """``pgtask audit``: a header and one aligned line per entry, newest first."""
    if not entries:
        return ["no audit entries match"]
    rows = [_AUDIT_HEADER] + [
        (
            str(e.id), when(e.occurred_at), e.actor, e.action, _target(e),
            "-" if e.reason is None else _one_line(e.reason),
            "-" if e.details is None
            else json.dumps(e.details, ensure_ascii=False, sort_keys=True),
        )
        for e in entries
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_AUDIT_HEADER))]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if len(entries) == limit:
        out.append(f"(first {limit}; older ones: add --before {entries[-1].id})")
    return out


def audit_json(entries: Sequence[AuditRecord]) -> str:
    """``pgtask audit --json``: a JSON array of the entries, newest first, on one line."""
    return json.dumps(
        [dataclasses.asdict(entry) for entry in entries],
        default=json_default, ensure_ascii=False,
    )
