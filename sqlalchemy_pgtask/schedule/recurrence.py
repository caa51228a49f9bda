"""schedule.recurrence: when a schedule's occurrences fall; pure, no I/O (what a late one becomes is
`sqlalchemy_pgtask.schedule.misfire`'s).

Cron expressions are parsed and matched by ``croniter`` (5 fields, or 6 with seconds first),
always on naive wall-clock times of the schedule's time zone; this module maps those wall
times to instants, which is where daylight-saving time is decided (Debian cron's rules):

* **A time that does not exist** (spring forward): a fixed-time expression (neither its minute
  nor its hour field starts with ``*``) runs once, at the first instant after the gap; an
  expression with a wildcard minute or hour follows real time and skips the missing walls.
* **A time that happens twice** (fall back): a fixed-time expression runs once, the first
  time; a wildcard expression runs in both passes (``0 * * * *`` stays hourly in real time).

Intervals are arithmetic on an anchor (the schedule's cursor, always an occurrence) in whole
microseconds. Every instant here is an aware UTC `datetime`; "now" is always database time,
passed in by the caller.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from datetime import tzinfo as TzInfo
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter  # type: ignore[import-untyped]

from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.validation import DURATION_MAX_SECONDS

__all__ = [
    "Recurrence",
    "RecurrenceError",
    "check_cron",
    "check_interval",
    "check_timezone",
]

UTC: Final = timezone.utc
#: Shorthands expanded before parsing.
_MACROS: Final = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
#: Most wall times looked at for one answer (a per-second expression across an overlap
#: needs 3,600; a year of a sparse one, a handful).
_MAX_STEPS: Final = 200_000
_SECOND: Final = timedelta(seconds=1)
#: How far a search for an occurrence looks before it gives up (croniter's own bound).
_HORIZON: Final = timedelta(days=50 * 366)
_FIRST: Final = datetime.min
_LAST: Final = datetime.max
#: croniter's random field (``R``, ``R(0-29)``, ``R/5``): it draws anew every time the
#: expression is parsed, so the cursor, the misfire decision and the listed occurrences
#: would each see another schedule. Refused.
_RANDOM: Final = re.compile(r"r(\(\d+-\d+\))?(/\d+)?", re.IGNORECASE | re.ASCII)
_TICK: Final = timedelta(microseconds=1)


class RecurrenceError(Exception):
    """A stored definition that cannot be computed (bad expression or zone, no occurrence)."""


def _expand(expression: str) -> str:
    return _MACROS.get(expression.strip().lower(), expression.strip())


def check_cron(expression: object, field: str = "cron") -> str:
    """A cron expression croniter accepts, with 5 fields or 6 (seconds first)."""
    if not isinstance(expression, str):
        raise InvalidOptionError(field, f"must be a str, got {type(expression).__name__}")
    if not 1 <= len(expression.encode("utf-8", "replace")) <= 255 or "\x00" in expression:
        raise InvalidOptionError(field, "must be 1 to 255 bytes of text")
    fields = _expand(expression).split()
    if len(fields) not in (5, 6):
        raise InvalidOptionError(
            field, f"{expression!r} has {len(fields)} fields; give 5, or 6 with seconds first"
        )
    try:
        _recurrence_of(expression, UTC).next_after(datetime(2000, 1, 1, tzinfo=UTC))
    except RecurrenceError as exc:
        raise InvalidOptionError(field, f"{expression!r}: {exc}") from None
    return expression


def check_timezone(name: object, field: str = "timezone") -> ZoneInfo:
    """An IANA time zone the system's tz database knows."""
    if not isinstance(name, str) or not name or len(name) > 64 or "\x00" in name:
        raise InvalidOptionError(field, f"must be an IANA time zone name, got {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidOptionError(field, f"unknown time zone {name!r}") from None


def check_interval(value: object, field: str = "every") -> float:
    """Seconds (or a `timedelta`) from 1 s to `DURATION_MAX_SECONDS`."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidOptionError(field, f"must be seconds or a timedelta, got {value!r}")
    if not 1 <= seconds <= DURATION_MAX_SECONDS:  # NaN fails too
        raise InvalidOptionError(
            field, f"must be between 1 and {DURATION_MAX_SECONDS} seconds, got {value!r}"
        )
    return float(seconds)


def _recurrence_of(cron: str, zone: TzInfo) -> Recurrence:
    return Recurrence(cron=cron, interval=None, zone=zone)


@dataclass(frozen=True)
class Recurrence:
    """A schedule's rhythm: a cron expression in a zone, or an interval (then ``cron`` None)."""

    cron: str | None
    interval: timedelta | None
    zone: TzInfo = UTC

    @classmethod
    def of(cls, cron: str | None, interval_seconds: float | None, zone: str) -> Recurrence:
        """From a stored row; `RecurrenceError` if it cannot be computed."""
        if cron is None:
            if interval_seconds is None or not interval_seconds >= 1:
                raise RecurrenceError(f"bad interval {interval_seconds!r}")
            return cls(cron=None, interval=timedelta(seconds=interval_seconds))
        try:
            tz: TzInfo = UTC if zone == "UTC" else ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise RecurrenceError(f"unknown time zone {zone!r}") from None
        return cls(cron=cron, interval=None, zone=tz)

    # -- cron machinery ------------------------------------------------------------------

    @functools.cached_property
    def _fields(self) -> list[str]:
        return _expand(self.cron or "").split()

    @functools.cached_property
    def _wildcard(self) -> bool:
        """Debian's rule: a ``*`` minute or hour follows real time across DST changes."""
        fields = self._fields
        minute, hour = (fields[0], fields[1]) if len(fields) == 5 else (fields[1], fields[2])
        return minute.startswith("*") or hour.startswith("*")

    def _walls(self, start: datetime, *, backwards: bool) -> Iterator[datetime]:
        """Matching naive wall times after ``start`` (before it when ``backwards``)."""
        fields = self._fields
        if any(_RANDOM.fullmatch(part) for f in fields for part in f.split(",")):
            raise RecurrenceError("a random field (R) would fire at other times on every read")
        try:
            it = croniter(
                " ".join(fields), start, ret_type=datetime, second_at_beginning=len(fields) == 6
            )
        except (CroniterError, ValueError, KeyError) as exc:
            raise RecurrenceError(f"invalid cron expression: {exc}") from None
        for _ in range(_MAX_STEPS):
            try:
                wall = it.get_prev(datetime) if backwards else it.get_next(datetime)
            except (CroniterError, ValueError, OverflowError):
                raise RecurrenceError("it has no occurrence within 50 years") from None
            yield wall
        raise RecurrenceError("too many steps to find an occurrence")

    def _offsets(self, wall: datetime) -> tuple[timedelta, timedelta]:
        first = wall.replace(tzinfo=self.zone, fold=0).utcoffset()
        second = wall.replace(tzinfo=self.zone, fold=1).utcoffset()
        assert first is not None
        assert second is not None
        return first, second

    def _transition(self, wall: datetime) -> datetime:
        """The instant the new offset starts, for a wall time in a gap (spring forward),
        found by bisection between the wall time's two readings to the microsecond."""
        first, second = self._offsets(wall)
        naive = wall.replace(fold=0, tzinfo=UTC)
        low, high = naive - second, naive - first
        while high - low > _TICK:
            middle = low + (high - low) / 2
            if middle.astimezone(self.zone).utcoffset() == second:
                high = middle
            else:
                low = middle
        return high

    def _gap(self, wall: datetime) -> tuple[datetime, datetime]:
        """The first wall time of the gap ``wall`` falls in, and the first after it."""
        at = self._transition(wall)
        first, second = self._offsets(wall)
        return (at + first).replace(tzinfo=None), (at + second).replace(tzinfo=None)

    def _instants(self, wall: datetime) -> tuple[datetime | None, datetime | None]:
        """The instant a wall time runs at (None: it does not), and its second-pass instant
        in an overlap (wildcard expressions only)."""
        first, second = self._offsets(wall)
        naive = wall.replace(fold=0, tzinfo=UTC)
        if first == second:
            return naive - first, None
        if first > second:  # happens twice: first pass, and the second for wildcards
            return naive - first, (naive - second if self._wildcard else None)
        if self._wildcard:  # does not exist
            return None, None
        # Fixed time in a gap: the first instant of the new offset.
        return self._transition(wall).replace(microsecond=0), None

    def _wall_of(self, instant: datetime) -> datetime:
        return instant.astimezone(self.zone).replace(tzinfo=None, fold=0)

    def _overlap(self, wall: datetime) -> timedelta:
        first, second = self._offsets(wall)
        return first - second if first > second else timedelta(0)

    def _cron_next(self, after: datetime) -> datetime:
        wall = self._wall_of(after)
        if self._wildcard:
            wall -= self._overlap(wall)  # earlier walls' second passes may still come
        horizon = wall + _HORIZON if wall < _LAST - _HORIZON else _LAST
        best: datetime | None = None
        start = wall.replace(microsecond=0) - _SECOND
        while True:
            for candidate in self._walls(start, backwards=False):
                if candidate > horizon:
                    raise RecurrenceError("it has no occurrence within 50 years")
                first, second = self._instants(candidate)
                if first is None and second is None:
                    # A wildcard wall in a gap: so is every wall up to its end. Jump there,
                    # not one wall at a time (an hour of seconds, every year for 50 years).
                    start = self._gap(candidate)[1] - _SECOND
                    break
                if second is not None and second > after and (best is None or second < best):
                    best = second
                if first is not None and first > after:
                    return first if best is None else min(first, best)

    def _cron_latest(self, at: datetime) -> datetime:
        wall = self._wall_of(at)
        wall += self._overlap(wall)  # later walls' first passes may already have come
        horizon = wall - _HORIZON if wall > _FIRST + _HORIZON else _FIRST
        found: datetime | None = None
        start = wall.replace(microsecond=0) + _SECOND
        while True:
            for candidate in self._walls(start, backwards=True):
                if candidate < horizon:
                    raise RecurrenceError("it has no occurrence within 50 years")
                first, second = self._instants(candidate)
                if first is None and second is None:
                    start = self._gap(candidate)[0]  # the walls before the gap exist
                    break
                if second is not None and second <= at:
                    return second if found is None else max(found, second)
                if found is not None and (second is None or second <= found):
                    return found
                if first is not None and first <= at and found is None:
                    found = first
                    if second is None and not self._overlap(candidate):
                        return found

    # -- both kinds ----------------------------------------------------------------------

    def _step(self) -> int:
        assert self.interval is not None
        return max(1, round(self.interval / _TICK))

    def next_after(self, after: datetime, anchor: datetime | None = None) -> datetime:
        """The first occurrence strictly after ``after``; intervals count from ``anchor``."""
        if self.interval is None:
            return self._cron_next(after)
        base = after if anchor is None else anchor
        step = self._step()
        steps = (after - base) // _TICK // step + 1
        try:
            return base + steps * step * _TICK
        except OverflowError:
            raise RecurrenceError("it has no occurrence before the year 10000") from None

    def latest(self, at: datetime, anchor: datetime | None = None) -> datetime:
        """The last occurrence at or before ``at``."""
        if self.interval is None:
            return self._cron_latest(at)
        base = at if anchor is None else anchor
        step = self._step()
        return base + ((at - base) // _TICK // step) * step * _TICK

    def first_from(self, start: datetime) -> datetime:
        """The first occurrence at or after ``start`` (for intervals, ``start`` itself)."""
        if self.interval is not None:
            return start
        return self._cron_next(start - _TICK)

    def upcoming(self, cursor: datetime, count: int) -> list[datetime]:
        """``cursor`` and the occurrences after it, ``count`` in all."""
        found = [cursor]
        while len(found) < count:
            try:
                found.append(self.next_after(found[-1], cursor))
            except RecurrenceError:  # no more of them: the calendar ends (year 9999) first
                break
        return found[:count]
