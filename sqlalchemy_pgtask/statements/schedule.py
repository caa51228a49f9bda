"""statements.schedule: reading due schedules and materialising their occurrences; no I/O.

The materialiser's transaction: `DUE_SCHEDULES` locks a batch of due schedules (``SKIP
LOCKED``: concurrent materialisers take different ones), then, per schedule and in its own
savepoint, `MATERIALIZE` inserts the occurrences' tasks and advances the cursor in one
statement, or `ADVANCE` only moves the cursor (nothing to create, or a failure to record).
The unique index ``ix_tasks_schedule_occurrence`` makes a second insert of one occurrence a
no-op, however the materialisers race.
"""

from __future__ import annotations

import typing
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Double,
    Insert,
    Integer,
    Select,
    Table,
    Text,
    Update,
    all_,
    bindparam,
    func,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from sqlalchemy_pgtask._defaults import SCHEDULE_HEADER
from sqlalchemy_pgtask.models import Schedule
from sqlalchemy_pgtask.statements._common import NOW, TSTZ, UUID_T, arrays, tasks
from sqlalchemy_pgtask.statements._fence import const
from sqlalchemy_pgtask.states import ACTIVE_STATES

__all__ = [
    "ADVANCE",
    "DUE_SCHEDULES",
    "MATERIALIZE",
    "NOTE_ERROR",
    "RUN_NOW",
    "SECONDS_UNTIL_NEXT_SCHEDULE",
    "schedules",
]

schedules = typing.cast(Table, Schedule.__table__)


def _due() -> Select[Any]:
    last = tasks.alias("last_task")
    last_active = (
        select(last.c.state.in_(ACTIVE_STATES))
        .where(last.c.id == schedules.c.last_task_id)
        .scalar_subquery()
    )
    return (
        select(*schedules.c, func.coalesce(last_active, False).label("previous_active"))
        .where(
            schedules.c.paused_at.is_(None),
            schedules.c.next_run_at <= bindparam("now", type_=TSTZ),
            schedules.c.name != all_(bindparam("exclude", type_=ARRAY(Text))),
        )
        .order_by(schedules.c.next_run_at)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(of=schedules, key_share=True, skip_locked=True)
    )


#: Due, unpaused schedules (``next_run_at <= :now``, none named in ``:exclude``), earliest
#: first, at most ``:limit``; each row locked ``FOR NO KEY UPDATE``, rows other materialisers
#: hold skipped. Adds ``previous_active``: whether the last occurrence's task is still pending,
#: running or waiting (a plain read; the task is not locked). Served by ``ix_schedules_due``.
DUE_SCHEDULES: Final = _due()


#: An instant as ISO 8601 in UTC, whatever the session's ``TimeZone``.
_ISO_UTC: Final = 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'


def _occurrence_header(
    name: ColumnElement[Any], instant: ColumnElement[Any]
) -> ColumnElement[Any]:
    utc = func.to_char(func.timezone(const("UTC"), instant), const(_ISO_UTC))
    return func.jsonb_build_object(
        const(SCHEDULE_HEADER),
        func.jsonb_build_object(const("name"), name, const("scheduled_for"), utc),
    )


def _from_template(template: Select[Any]) -> Insert:
    """The tasks of ``template``'s rows (a task id, the schedule's row, the occurrence), an
    occurrence that already has its task skipped (``ix_tasks_schedule_occurrence``)."""
    return (
        pg_insert(tasks)
        .from_select(
            [
                "id", "queue", "name", "version", "payload", "headers", "priority",
                "max_attempts", "run_at", "timeout_seconds", "schedule_name", "scheduled_for",
                "concurrency_key", "concurrency_limit",
            ],
            template,
        )
        .on_conflict_do_nothing(
            index_elements=[tasks.c.schedule_name, tasks.c.scheduled_for],
            index_where=tasks.c.schedule_name.is_not(None),
        )
    )


def _template(s: Any, task_id: Any, occurrence: Any, run_at: Any) -> Select[Any]:
    return select(
        task_id, s.c.queue, s.c.task_name, s.c.version, s.c.payload,
        s.c.headers.op("||")(_occurrence_header(s.c.name, occurrence)), s.c.priority,
        s.c.max_attempts, run_at, s.c.timeout_seconds, s.c.name, occurrence,
        s.c.concurrency_key, s.c.concurrency_limit,
    )


def _materialize() -> Update:
    occurrence = arrays(
        "occurrence", ("ids", "id", UUID_T), ("occurrences", "scheduled_for", TSTZ)
    )
    s = schedules.alias("template")
    inserted = (
        _from_template(
            _template(
                s, occurrence.c.id, occurrence.c.scheduled_for,
                func.greatest(occurrence.c.scheduled_for, NOW),
            )
            .select_from(occurrence.join(s, s.c.name == bindparam("schedule", type_=Text)))
            .order_by(occurrence.c.scheduled_for),
        )
        .returning(tasks.c.id, tasks.c.scheduled_for)
        .cte("inserted")
    )
    newest = select(inserted.c.id).order_by(inserted.c.scheduled_for.desc()).limit(1)
    existing = select(tasks.c.id).where(
        tasks.c.schedule_name == bindparam("schedule", type_=Text),
        tasks.c.scheduled_for == bindparam("last", type_=TSTZ),
    )
    return (
        update(schedules)
        .where(schedules.c.name == bindparam("schedule", type_=Text))
        .values(
            next_run_at=bindparam("cursor", type_=TSTZ),
            last_task_id=func.coalesce(
                newest.scalar_subquery(), existing.scalar_subquery(), schedules.c.last_task_id
            ),
            last_error=null(),
        )
        .returning(select(func.count()).select_from(inserted).scalar_subquery().label("created"))
    )


#: Inserts one task per occurrence (``:ids`` and ``:occurrences``, parallel arrays, oldest
#: first) from schedule ``:schedule``'s template, ``run_at`` the occurrence or now if later,
#: its headers the template's plus `SCHEDULE_HEADER` (the schedule and the occurrence);
#: an occurrence that already has its task is skipped (``ON CONFLICT DO NOTHING`` on
#: ``ix_tasks_schedule_occurrence``). In the same statement the cursor moves to
#: ``:cursor``, ``last_task_id`` to the task of ``:last`` (the newest occurrence) and
#: ``last_error`` is cleared. A queue at capacity fails the insert (SQLSTATE PT001) and so
#: the whole statement: nothing is created and the cursor stays. Returns ``created``.
MATERIALIZE: Final = _materialize()


def _run_now() -> Insert:
    s = schedules.alias("template")
    return _from_template(
        _template(s, bindparam("id", type_=UUID_T), bindparam("at", type_=TSTZ),
                  bindparam("at", type_=TSTZ))
        .where(s.c.name == bindparam("schedule", type_=Text))
    ).returning(tasks.c.id, tasks.c.queue, tasks.c.scheduled_for)


#: Inserts one task, id ``:id``, from schedule ``:schedule``'s template, its occurrence and
#: its ``run_at`` ``:at`` (database now, read by the caller: an operator's "run now", outside
#: the cursor); nothing if that schedule already has a task for that instant. Reads the
#: schedule by its primary key; the cursor is not moved. Returns ``id, queue,
#: scheduled_for`` of the task it created.
RUN_NOW: Final = _run_now()


def _advance() -> Update:
    return (
        update(schedules)
        .where(schedules.c.name == bindparam("schedule", type_=Text))
        .values(
            next_run_at=bindparam("cursor", type_=TSTZ),
            last_error=bindparam("error", type_=Text),
        )
    )


#: Moves schedule ``:schedule``'s cursor to ``:cursor`` without creating a task, setting
#: ``last_error`` to ``:error`` (None clears it). Locks that schedule's row.
ADVANCE: Final = _advance()


def _note_error() -> Update:
    return (
        update(schedules)
        .where(schedules.c.name == bindparam("schedule", type_=Text))
        .values(last_error=bindparam("error", type_=Text))
    )


#: Sets schedule ``:schedule``'s ``last_error`` to ``:error``, its cursor left where it is
#: (a schedule held back for now). Locks that schedule's row.
NOTE_ERROR: Final = _note_error()


def _seconds_until_next() -> Select[Any]:
    return select(
        func.extract("epoch", func.min(schedules.c.next_run_at) - NOW).cast(Double)
    ).where(
        schedules.c.paused_at.is_(None),
        schedules.c.name != all_(bindparam("exclude", type_=ARRAY(Text))),
    )


#: Seconds until the earliest unpaused schedule not named in ``:exclude`` falls due
#: (negative: overdue; NULL: none). Reads ``ix_schedules_due``.
SECONDS_UNTIL_NEXT_SCHEDULE: Final = _seconds_until_next()
