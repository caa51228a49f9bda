"""schedule.materialize: turns due schedule occurrences into tasks, in one transaction; leaderless.

Any number of workers (or ``materialize_schedules`` callers) may run this at once:

1. read database now (``pgtask.now()``) once and lock a batch of due, unpaused schedules
   ``FOR NO KEY UPDATE SKIP LOCKED`` (so concurrent materialisers take different schedules
   and never wait for each other): `lock_due`;
2. compute each one's occurrences in Python from that now (the grace, misfire and overlap
   policies, `plan_occurrences`): `plan_due`, pure, which the worker runs in a thread so
   that a slow expression never stalls its event loop;
3. per schedule, in its own savepoint, insert their tasks and advance the cursor in one
   statement: `apply_plans`. The unique ``(schedule_name, scheduled_for)`` index makes an
   occurrence that already has its task a no-op, so even a cursor moved back cannot
   duplicate one.

Failures stay with their schedule:

* a queue at capacity (PT001) rolls the savepoint back and leaves the cursor at the first
  occurrence not created: it waits there until there is room (never lost, never doubled);
* a deterministic failure (a definition that cannot be computed, a task the database
  refuses) rolls the savepoint back, records ``last_error`` and moves the cursor to the
  first occurrence at least `FAILURE_RETRY` after now (the occurrences in between are not
  created), so a broken schedule is retried about once a minute, not on every pass;
* a schedule held back by another transaction (its insert waited past ``lock_timeout`` for a
  capped queue's row, ran past ``statement_timeout``, deadlocked) rolls its savepoint back,
  keeps its cursor, notes why in ``last_error`` and is reported ``held``: the others in the
  batch go on, and a later pass tries it again (the worker after a growing rest);
* a lost connection aborts the whole transaction: nothing of it commits, and the next pass
  tries again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Connection, select, text
from sqlalchemy.exc import DBAPIError

from sqlalchemy_pgtask._failures import HELD_BACK, brief, is_transient
from sqlalchemy_pgtask._ids import new_ids
from sqlalchemy_pgtask.schedule.misfire import Occurrences, plan_occurrences
from sqlalchemy_pgtask.schedule.recurrence import Recurrence, RecurrenceError
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.statements.schedule import ADVANCE, DUE_SCHEDULES, MATERIALIZE, NOTE_ERROR

__all__ = [
    "FAILURE_RETRY", "MaterializeReport", "Planned", "apply_plans", "lock_due", "materialize_in",
    "plan_due",
]

logger = logging.getLogger("sqlalchemy_pgtask.schedule")

#: How long a schedule that failed deterministically rests before it is tried again.
FAILURE_RETRY: Final = timedelta(seconds=60)
_CAPACITY: Final = "PT001"
_SAVEPOINT: Final = "pgtask_schedule"
_ERROR_MAX: Final = 1000
#: How ``last_error`` of a schedule whose occurrence waits for room starts: the next pass
#: keeps that occurrence due (`plan_occurrences`' ``waiting``).
_WAITING: Final = "waiting for room: "
#: How ``last_error`` of a schedule held back by another transaction starts.
_HELD_BACK: Final = "held back: "
#: What stops one schedule for now, not the pass (`_failures.HELD_BACK`: a lock, a timeout, a
#: deadlock, a serialisation failure). Its savepoint rolls back, its cursor stays.
_HELD: Final = HELD_BACK.keys()


@dataclass
class MaterializeReport:
    """What one materialisation transaction did."""

    #: Due schedules it locked (others held by concurrent materialisers were skipped).
    selected: int = 0
    #: Tasks it created.
    created: int = 0
    #: Schedules whose occurrence waits at the cursor for room in a full queue.
    waiting: list[str] = field(default_factory=list)
    #: Schedules whose failure was recorded in ``last_error``.
    failed: list[str] = field(default_factory=list)
    #: Schedules held back by another transaction (a lock, a timeout): cursor unchanged,
    #: the reason in ``last_error``; a later pass tries again.
    held: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _savepoint(connection: Connection) -> Iterator[None]:
    connection.execute(text(f"SAVEPOINT {_SAVEPOINT}"))
    try:
        yield
    except BaseException:
        connection.execute(text(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}"))
        connection.execute(text(f"RELEASE SAVEPOINT {_SAVEPOINT}"))
        raise
    connection.execute(text(f"RELEASE SAVEPOINT {_SAVEPOINT}"))


#: insufficient_privilege: a role without the worker's grants.
_PERMISSION_DENIED: Final = "42501"


def _sqlstate(exc: DBAPIError) -> str | None:
    return getattr(exc.orig, "sqlstate", None)


def _insert(connection: Connection, name: str, due: Sequence[datetime], cursor: datetime) -> int:
    row = connection.execute(
        MATERIALIZE,
        {
            "schedule": name, "ids": new_ids(len(due)), "occurrences": list(due),
            "last": due[-1], "cursor": cursor,
        },
    ).first()
    return 0 if row is None else int(row.created)


def _advance(connection: Connection, name: str, cursor: datetime, error: str | None) -> None:
    connection.execute(ADVANCE, {"schedule": name, "cursor": cursor, "error": error})


def _retry_cursor(row: Mapping[Any, Any], recurrence: Recurrence | None, now: datetime) -> datetime:
    """Where a schedule that failed deterministically rests: its first occurrence at least
    `FAILURE_RETRY` after now."""
    retry_at = now + FAILURE_RETRY
    if recurrence is None:
        return retry_at
    try:
        return max(retry_at, recurrence.next_after(retry_at, row["next_run_at"]))
    except RecurrenceError:
        return retry_at


def _fail(
    connection: Connection,
    row: Mapping[Any, Any],
    cursor: datetime,
    reason: str,
    report: MaterializeReport,
) -> None:
    message = f"{reason}"[:_ERROR_MAX]
    logger.warning(
        "schedule %r failed (%s); it is tried again at its occurrence %s",
        row["name"], message, cursor.isoformat(),
    )
    _advance(connection, row["name"], cursor, message)
    report.failed.append(row["name"])


def _wait_for_room(
    connection: Connection,
    row: Mapping[Any, Any],
    plan: Occurrences,
    report: MaterializeReport,
    exc: DBAPIError,
) -> None:
    """The batch did not fit: create the occurrences that fit, oldest first; the cursor
    stays at the first one that did not."""
    due = plan.due
    index = 0
    if len(due) > 1:
        while index < len(due):
            after = due[index + 1] if index + 1 < len(due) else plan.next_run_at
            try:
                with _savepoint(connection):
                    one = due[index : index + 1]
                    report.created += _insert(connection, row["name"], one, after)
            except DBAPIError as again:
                if _sqlstate(again) != _CAPACITY:
                    raise
                break
            index += 1
    if index == len(due):
        return
    reason = getattr(getattr(exc.orig, "diag", None), "message_primary", None) or brief(exc)
    logger.info(
        "schedule %r: %s; occurrence %s waits for room", row["name"], reason, due[index].isoformat()
    )
    _advance(
        connection, row["name"], due[index],
        f"{_WAITING}{reason} (occurrence {due[index].isoformat()})"[:_ERROR_MAX],
    )
    report.waiting.append(row["name"])


@dataclass(frozen=True)
class Planned:
    """One locked due schedule and what its materialisation does (`plan`)."""

    row: Mapping[Any, Any]
    #: None: the stored definition cannot be computed (``plan`` is None too).
    recurrence: Recurrence | None
    #: None: computing the occurrences failed, for ``failure``; the schedule rests until
    #: ``retry_at``.
    plan: Occurrences | None
    failure: str = ""
    retry_at: datetime | None = None


def lock_due(
    connection: Connection, limit: int, exclude: Sequence[str] = ()
) -> tuple[datetime, Sequence[Mapping[Any, Any]]]:
    """Database now, and up to ``limit`` due schedules (none named in ``exclude``) locked in
    ``connection``'s current transaction (`DUE_SCHEDULES`)."""
    now: datetime = connection.execute(select(NOW)).scalar_one().astimezone(timezone.utc)
    rows = connection.execute(
        DUE_SCHEDULES, {"now": now, "limit": limit, "exclude": list(exclude)}
    ).mappings().all()
    return now, rows


def _plan_one(row: Mapping[Any, Any], now: datetime) -> Planned:
    recurrence: Recurrence | None = None
    try:
        recurrence = Recurrence.of(row["cron"], row["interval_seconds"], row["timezone"])
        plan = plan_occurrences(
            recurrence,
            cursor=row["next_run_at"].astimezone(timezone.utc),
            now=now,
            misfire=row["misfire"],
            catch_up_limit=row["catch_up_limit"],
            previous_active=bool(row["previous_active"]) and row["overlap"] == "skip",
            overlap=row["overlap"],
            waiting=(row["last_error"] or "").startswith(_WAITING),
        )
    except RecurrenceError as exc:
        return Planned(row, recurrence, None, f"cannot compute occurrences: {exc}",
                       _retry_cursor(row, recurrence, now))
    return Planned(row, recurrence, plan)


def plan_due(rows: Sequence[Mapping[Any, Any]], now: datetime) -> list[Planned]:
    """What materialising each of ``rows`` does at ``now``: pure computation (croniter,
    time zones), no I/O, so the worker runs it in a thread, off its event loop."""
    return [_plan_one(row, now) for row in rows]


def _materialize_one(
    connection: Connection, planned: Planned, now: datetime, report: MaterializeReport
) -> None:
    row, recurrence, plan = planned.row, planned.recurrence, planned.plan
    name = row["name"]
    if plan is None:
        assert planned.retry_at is not None
        _fail(connection, row, planned.retry_at, planned.failure, report)
        return
    if plan.dropped:
        logger.info(
            "schedule %r: occurrences from %s missed (misfire %r, overlap %r)",
            name, row["next_run_at"].isoformat(), row["misfire"], row["overlap"],
        )
    if not plan.due:
        _advance(connection, name, plan.next_run_at, None)
        return
    try:
        with _savepoint(connection):
            report.created += _insert(connection, name, plan.due, plan.next_run_at)
    except DBAPIError as exc:
        state = _sqlstate(exc)
        if state == _CAPACITY:
            try:
                _wait_for_room(connection, row, plan, report, exc)
            except DBAPIError as again:
                if _sqlstate(again) not in _HELD:
                    raise
                _set_aside(connection, row, again, report)
        elif state in _HELD:
            _set_aside(connection, row, exc, report)
        elif is_transient(exc) or state == _PERMISSION_DENIED:
            # Not this schedule's fault: a lost connection ends the pass, and a missing
            # privilege is the deployment's to fix.
            raise
        else:
            _fail(connection, row, _retry_cursor(row, recurrence, now),
                  f"the database refused its task: {brief(exc)}", report)


def _set_aside(
    connection: Connection, row: Mapping[Any, Any], exc: DBAPIError, report: MaterializeReport
) -> None:
    """Another transaction holds what this schedule's insert needs (a capped queue's row, a
    task it references ...): leave it for a later pass, and let the batch go on."""
    reason = brief(exc)
    logger.warning(
        "schedule %r held back (%s); its occurrences wait for a later pass", row["name"], reason
    )
    if not (row["last_error"] or "").startswith(_WAITING):  # keep "waiting" for the grace
        connection.execute(
            NOTE_ERROR, {"schedule": row["name"], "error": f"{_HELD_BACK}{reason}"[:_ERROR_MAX]}
        )
    report.held.append(row["name"])


def apply_plans(
    connection: Connection, planned: Sequence[Planned], now: datetime
) -> MaterializeReport:
    """Create the tasks and move the cursors `plan_due` decided, in ``connection``'s current
    transaction (the one that locked the rows); never commits."""
    report = MaterializeReport(selected=len(planned))
    for one in planned:
        _materialize_one(connection, one, now, report)
    return report


def materialize_in(
    connection: Connection, limit: int, exclude: Sequence[str] = ()
) -> MaterializeReport:
    """Materialise up to ``limit`` due schedules (none named in ``exclude``) in
    ``connection``'s current transaction; never commits."""
    now, rows = lock_due(connection, limit, exclude)
    return apply_plans(connection, plan_due(rows, now), now)
