"""schedule.spec: a schedule definition, validated before any SQL; pure, no I/O.

Shared by `sqlalchemy_pgtask.schedule` (the API and CLI) and `Registry.schedule` (schedules
declared in code), so both refuse the same mistakes with the same typed errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models._operations import CATCH_UP_MAX, MISFIRE_POLICIES, OVERLAP_POLICIES
from sqlalchemy_pgtask.schedule.recurrence import (
    Recurrence,
    check_cron,
    check_interval,
    check_timezone,
)
from sqlalchemy_pgtask.validation import (
    HEADERS_MAX_BYTES,
    INT2_MAX,
    INT2_MIN,
    INT4_MAX,
    PAYLOAD_MAX_BYTES,
    check_concurrency,
    check_int_range,
    check_queue_name,
    check_run_at,
    check_task_name,
    check_time_limit,
    dump_headers,
    dump_json,
)

__all__ = ["DEFINITION_FIELDS", "ScheduleSpec", "schedule_spec"]

#: The columns that make a definition; a change in any of them resets the cursor.
DEFINITION_FIELDS: Final = (
    "cron", "interval_seconds", "timezone", "misfire", "catch_up_limit", "overlap", "queue",
    "task_name", "version", "payload", "headers", "priority", "max_attempts", "timeout_seconds",
    "concurrency_key", "concurrency_limit",
)

#: What `SCHEDULE_HEADER` adds to a task's headers at most (its name, a 255-byte schedule
#: name, an instant), kept free in a schedule's headers so that its tasks fit the limit.
OCCURRENCE_HEADER_ROOM: Final = 512


@dataclass(frozen=True)
class ScheduleSpec:
    """A checked schedule definition; ``payload`` and ``headers`` hold their JSON text."""

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
    payload: str
    headers: str
    priority: int
    max_attempts: int | None
    timeout_seconds: float | None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    start_at: datetime | None = None

    @property
    def recurrence(self) -> Recurrence:
        return Recurrence.of(self.cron, self.interval_seconds, self.timezone)

    def values(self) -> dict[str, Any]:
        """The definition's column values (JSON decoded, as the database returns them)."""
        values = {field: getattr(self, field) for field in DEFINITION_FIELDS}
        values["payload"] = json.loads(self.payload)
        values["headers"] = json.loads(self.headers)
        return values


def _choice(field: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidOptionError(field, f"must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def schedule_spec(
    name: object,
    *,
    task_name: object,
    queue: object,
    version: object = 1,
    cron: object = None,
    every: object = None,
    timezone: object = "UTC",
    payload: object = None,
    headers: Mapping[str, Any] | None = None,
    priority: object = 0,
    max_attempts: object = None,
    timeout: object = None,
    misfire: object = "latest",
    catch_up_limit: object = None,
    overlap: object = "allow",
    start_at: object = None,
    concurrency_key: object = None,
    concurrency_limit: object = None,
) -> ScheduleSpec:
    """Check every option; raises a `ValidationError` naming the first bad one."""
    checked_name = check_task_name(name, "name")
    if (cron is None) == (every is None):
        raise InvalidOptionError("cron", "give exactly one of cron and every")
    zone = check_timezone(timezone)
    interval = None if every is None else check_interval(every)
    if interval is not None and timezone != "UTC":
        raise InvalidOptionError("timezone", "an interval schedule has no time zone")
    expression = None if cron is None else check_cron(cron)
    if expression is not None:
        try:
            Recurrence(cron=expression, interval=None, zone=zone).next_after(
                datetime.now(tz=zone)
            )
        except Exception as exc:  # no future occurrence in this zone
            raise InvalidOptionError("cron", f"{cron!r}: {exc}") from None
    policy = _choice("misfire", misfire, MISFIRE_POLICIES)
    if policy == "catch_up":
        if catch_up_limit is None:
            raise InvalidOptionError("catch_up_limit", "misfire='catch_up' needs a limit")
        limit: int | None = check_int_range("catch_up_limit", catch_up_limit, 1, CATCH_UP_MAX)
    elif catch_up_limit is not None:
        raise InvalidOptionError("catch_up_limit", "only misfire='catch_up' takes a limit")
    else:
        limit = None
    if isinstance(timeout, timedelta) or timeout is not None:
        timeout_seconds = check_time_limit("timeout", timeout)
    else:
        timeout_seconds = None
    key, key_limit = check_concurrency(concurrency_key, concurrency_limit)
    return ScheduleSpec(
        name=checked_name,
        task_name=check_task_name(task_name, "task"),
        queue=check_queue_name(queue),
        version=check_int_range("version", version, 1, INT4_MAX),
        cron=expression,
        interval_seconds=interval,
        timezone=zone.key,
        misfire=policy,
        catch_up_limit=limit,
        overlap=_choice("overlap", overlap, OVERLAP_POLICIES),
        payload=dump_json("payload", payload, PAYLOAD_MAX_BYTES),
        headers=dump_headers(
            headers, max_bytes=HEADERS_MAX_BYTES - OCCURRENCE_HEADER_ROOM
        ),
        priority=check_int_range("priority", priority, INT2_MIN, INT2_MAX),
        max_attempts=(
            None if max_attempts is None
            else check_int_range("max_attempts", max_attempts, 1, INT4_MAX)
        ),
        timeout_seconds=timeout_seconds,
        concurrency_key=key,
        concurrency_limit=key_limit,
        start_at=None if start_at is None else check_run_at("start_at", start_at),
    )
