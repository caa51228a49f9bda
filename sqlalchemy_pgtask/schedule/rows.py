"""schedule.rows: a schedule's row read and written in the caller's transaction; the work
behind the public functions of `sqlalchemy_pgtask.schedule`, sync only (the async twins run
it with ``run_sync``). Never commits.

A write that gives a schedule a new cursor (a new or changed definition, a resume) also
notifies the workers in the same transaction (`READY_CHANNEL`, payload `WAKE_ALL`): at commit
every worker runs its maintenance passes, the materialiser among them, which then sleeps
exactly until the new cursor. Otherwise a materialiser resting for its interval (5 s by
default) would notice the schedule only then. No commit, no notification.
"""

from __future__ import annotations

import dataclasses
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Connection, Table, cast, delete, func, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from sqlalchemy_pgtask._atomic import audited_unit
from sqlalchemy_pgtask._connection import READY_CHANNEL, WAKE_ALL, translated_errors
from sqlalchemy_pgtask._ids import new_ids
from sqlalchemy_pgtask.audit import audit_statement
from sqlalchemy_pgtask.errors import PgTaskError
from sqlalchemy_pgtask.models import Schedule, Task
from sqlalchemy_pgtask.schedule.recurrence import Recurrence, RecurrenceError
from sqlalchemy_pgtask.schedule.spec import DEFINITION_FIELDS, ScheduleSpec
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.statements.schedule import RUN_NOW

__all__ = [
    "UPCOMING", "ScheduleInfo", "ScheduleNotFound", "change", "read", "run_now", "write",
]

_schedules = typing.cast(Table, Schedule.__table__)
#: Upcoming occurrences a `ScheduleInfo` lists unless asked for another number.
UPCOMING: Final = 5


class ScheduleNotFound(PgTaskError):
    """No schedule exists with that name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleInfo:
    """One schedule as read in the caller's transaction, with its next occurrences."""

    name: str
    task_name: str
    queue: str
    version: int
    cron: str | None
    interval_seconds: float | None
    timezone: str
    misfire: str
    catch_up_limit: int | None
    overlap: str
    payload: Any
    headers: dict[str, Any]
    priority: int
    max_attempts: int | None
    timeout_seconds: float | None
    #: Declared in code (reconciled at worker start) rather than managed by API or CLI.
    declared: bool
    #: The cursor: the next occurrence to materialise (it is due once database now reaches it).
    next_run_at: datetime
    last_task_id: uuid.UUID | None
    last_error: str | None
    paused_at: datetime | None
    created_at: datetime
    updated_at: datetime
    #: The concurrency key and limit every occurrence is enqueued with (None: none).
    concurrency_key: str | None
    concurrency_limit: int | None
    #: The cursor and the occurrences after it (computed in Python; empty if it cannot be).
    upcoming: tuple[datetime, ...] = ()

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(ScheduleInfo) if f.name != "upcoming")


def _info(row: Mapping[Any, Any], upcoming: int) -> ScheduleInfo:
    values = {column: row[column] for column in _COLUMNS}
    occurrences: tuple[datetime, ...] = ()
    if upcoming:
        try:
            recurrence = Recurrence.of(row["cron"], row["interval_seconds"], row["timezone"])
            cursor = row["next_run_at"].astimezone(timezone.utc)
            occurrences = tuple(recurrence.upcoming(cursor, upcoming))
        except RecurrenceError:
            occurrences = ()
    return ScheduleInfo(**values, upcoming=occurrences)


def _now(connection: Connection) -> datetime:
    return typing.cast(datetime, connection.execute(select(NOW)).scalar_one()).astimezone(
        timezone.utc
    )


def _wake_materialisers(connection: Connection) -> None:
    connection.execute(select(func.pg_notify(READY_CHANNEL, WAKE_ALL)))


def _first_cursor(spec: ScheduleSpec, now: datetime) -> datetime:
    recurrence = spec.recurrence
    if spec.start_at is not None:
        return recurrence.first_from(spec.start_at.astimezone(timezone.utc))
    if spec.interval_seconds is not None:
        return now + timedelta(seconds=spec.interval_seconds)
    return recurrence.next_after(now)


def _definition_values(spec: ScheduleSpec) -> dict[str, Any]:
    values: dict[str, Any] = {f: getattr(spec, f) for f in DEFINITION_FIELDS}
    values["payload"] = cast(literal(spec.payload), JSONB)
    values["headers"] = cast(literal(spec.headers), JSONB)
    return values


def _audit_details(spec: ScheduleSpec, **extra: Any) -> dict[str, Any]:
    return {
        "task": spec.task_name, "queue": spec.queue, "cron": spec.cron,
        "every": spec.interval_seconds, "timezone": spec.timezone, **extra,
    }


def write(
    connection: Connection, spec: ScheduleSpec, actor: str | None, declared: bool
) -> ScheduleInfo:
    with audited_unit(connection), translated_errors(connection):
        now = _now(connection)
        cursor = _first_cursor(spec, now)
        created = connection.execute(
            pg_insert(_schedules)
            .values(name=spec.name, declared=declared, next_run_at=cursor,
                    **_definition_values(spec))
            .on_conflict_do_nothing(index_elements=[_schedules.c.name])
            .returning(*_schedules.c)
        ).mappings().first()
        if created is not None:
            _wake_materialisers(connection)
            if not declared:
                connection.execute(audit_statement(
                    "schedule.set", actor=actor, schedule=spec.name,
                    details=_audit_details(spec, created=True, next_run_at=cursor.isoformat()),
                ))
            return _info(created, UPCOMING)
        existing = connection.execute(
            select(_schedules).where(_schedules.c.name == spec.name).with_for_update()
        ).mappings().one()
        wanted = spec.values()
        changed = sorted(f for f in DEFINITION_FIELDS if existing[f] != wanted[f])
        if not changed and existing["declared"] == declared:
            return _info(existing, UPCOMING)
        values: dict[str, Any] = {
            **_definition_values(spec), "declared": declared, "updated_at": NOW,
        }
        if changed:  # a new definition starts afresh from database now
            values.update(next_run_at=cursor, last_error=None)
            _wake_materialisers(connection)
        row = connection.execute(
            update(_schedules).where(_schedules.c.name == spec.name).values(**values)
            .returning(*_schedules.c)
        ).mappings().one()
        if not declared:
            connection.execute(audit_statement(
                "schedule.set", actor=actor, schedule=spec.name,
                details=_audit_details(
                    spec, created=False, changed=changed or ["declared"],
                    next_run_at=row["next_run_at"].isoformat(),
                ),
            ))
        return _info(row, UPCOMING)


def change(
    connection: Connection, name: str, action: str, actor: str | None, reason: str | None
) -> ScheduleInfo:
    with audited_unit(connection), translated_errors(connection):
        row = connection.execute(
            select(_schedules).where(_schedules.c.name == name).with_for_update()
        ).mappings().first()
        if row is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        if action == "schedule.delete":
            connection.execute(delete(_schedules).where(_schedules.c.name == name))
        elif (row["paused_at"] is None) != (action == "schedule.pause"):
            return _info(row, UPCOMING)  # already as asked: nothing to change or audit
        elif action == "schedule.pause":
            row = connection.execute(
                update(_schedules).where(_schedules.c.name == name)
                .values(paused_at=NOW, updated_at=NOW).returning(*_schedules.c)
            ).mappings().one()
        else:
            # Occurrences that fell due while paused are skipped, whatever the misfire policy.
            cursor = row["next_run_at"]
            now = _now(connection)
            if cursor <= now:
                try:
                    recurrence = Recurrence.of(row["cron"], row["interval_seconds"],
                                               row["timezone"])
                    cursor = recurrence.next_after(now, cursor.astimezone(timezone.utc))
                except RecurrenceError:
                    pass  # the materialiser records why
            row = connection.execute(
                update(_schedules).where(_schedules.c.name == name)
                .values(paused_at=None, next_run_at=cursor, updated_at=NOW)
                .returning(*_schedules.c)
            ).mappings().one()
            _wake_materialisers(connection)
        connection.execute(audit_statement(action, actor=actor, reason=reason, schedule=name))
        return _info(row, UPCOMING)


def run_now(
    connection: Connection, name: str, actor: str | None, reason: str | None
) -> uuid.UUID:
    """Enqueue one occurrence of ``name`` now (`RUN_NOW`), make it the schedule's last task
    and audit it; the id of its task."""
    with audited_unit(connection), translated_errors(connection):
        # The lock the materialisers take: one of them, mid-pass on this schedule, finishes
        # first, so the last task set here is not overwritten by an older occurrence.
        found = connection.execute(
            select(_schedules.c.name).where(_schedules.c.name == name)
            .with_for_update(key_share=True)
        ).first()
        if found is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        (task_id,) = new_ids(1)
        at = _now(connection)
        task = connection.execute(RUN_NOW, {"id": task_id, "schedule": name, "at": at}).first()
        if task is None:  # that very instant already has its task (a frozen test clock)
            return connection.execute(
                select(Task.id).where(Task.schedule_name == name, Task.scheduled_for == at)
            ).scalar_one()
        connection.execute(
            update(_schedules).where(_schedules.c.name == name).values(last_task_id=task.id)
        )
        connection.execute(audit_statement(
            "schedule.run_now", actor=actor, reason=reason, task_id=task.id, queue=task.queue,
            schedule=name, details={"scheduled_for": task.scheduled_for.isoformat()},
        ))
        return typing.cast(uuid.UUID, task.id)


def read(connection: Connection, name: str | None, upcoming: int) -> list[ScheduleInfo]:
    query = select(_schedules).order_by(_schedules.c.name)
    if name is not None:
        query = query.where(_schedules.c.name == name)
    with translated_errors(connection):
        return [_info(row, upcoming) for row in connection.execute(query).mappings()]


