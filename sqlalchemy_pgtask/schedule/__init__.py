"""schedule: recurring tasks (cron or interval), managed inside the caller's transaction.

The public calls live in `api`; below it, `spec` checks a schedule's definition, `recurrence`
parses cron expressions and intervals in a time zone, `misfire` plans the occurrences a late
pass owes, `rows` reads and writes ``pgtask.schedules``, and `materialize` turns due
occurrences into tasks. See ``docs/schedules.md``.
"""

from __future__ import annotations

from sqlalchemy_pgtask.schedule.api import (
    MISFIRE_POLICIES,
    OVERLAP_POLICIES,
    MaterializeReport,
    ScheduleInfo,
    ScheduleNotFound,
    delete_schedule,
    delete_schedule_async,
    get_schedule,
    get_schedule_async,
    list_schedules,
    list_schedules_async,
    materialize_schedules,
    materialize_schedules_async,
    pause_schedule,
    pause_schedule_async,
    resume_schedule,
    resume_schedule_async,
    run_schedule_now,
    run_schedule_now_async,
    set_schedule,
    set_schedule_async,
)

__all__ = [
    "MISFIRE_POLICIES",
    "OVERLAP_POLICIES",
    "MaterializeReport",
    "ScheduleInfo",
    "ScheduleNotFound",
    "delete_schedule",
    "delete_schedule_async",
    "get_schedule",
    "get_schedule_async",
    "list_schedules",
    "list_schedules_async",
    "materialize_schedules",
    "materialize_schedules_async",
    "pause_schedule",
    "pause_schedule_async",
    "resume_schedule",
    "resume_schedule_async",
    "run_schedule_now",
    "run_schedule_now_async",
    "set_schedule",
    "set_schedule_async",
]
