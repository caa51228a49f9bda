"""Cron occurrences against an independent brute-force reference: random expressions, zones.

The reference below shares nothing with `schedule.recurrence` or croniter: it expands
each field itself, matches whole days (day-of-month and day-of-week OR-ed when both are
restricted, croniter's rule), and maps wall times to instants by scanning real time for the
Debian rules documented in docs/schedules.md (a missing fixed time runs at the first instant
after the gap, once; a repeated fixed time runs the first time; wildcard expressions follow
real time). Pure: no database.
"""

from __future__ import annotations

import calendar
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from sqlalchemy_pgtask import InvalidOptionError
from sqlalchemy_pgtask.schedule.recurrence import Recurrence, RecurrenceError, check_cron

UTC = timezone.utc
MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
ZONES = [
    "UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "America/Santiago",
    "Pacific/Chatham", "Asia/Kolkata", "America/Havana",
]


# -- the reference -------------------------------------------------------------------------


def _atom(token: str, low: int, high: int, names: list[str] | None) -> set[int]:
    def value(text: str) -> int:
        if names is not None and text.lower() in names:
            return names.index(text.lower()) + (1 if names is MONTHS else 0)
        return int(text)

    step = 1
    if "/" in token:
        token, step_text = token.split("/")
        step = int(step_text)
    if token == "*":
        first, last = low, high
    elif "-" in token:
        a, b = token.split("-")
        first, last = value(a), value(b)
    else:
        first = value(token)
        last = high if step > 1 else first
    return set(range(first, last + 1, step))


def _field(text: str, low: int, high: int, names: list[str] | None = None) -> set[int]:
    found: set[int] = set()
    for token in text.split(","):
        found |= _atom(token, low, high, names)
    return found


@dataclass(frozen=True)
class Reference:
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    months: frozenset[int]
    dom: str
    dow: str
    fixed: bool

    @classmethod
    def parse(cls, expression: str) -> Reference:
        fields = expression.split()
        seconds = {0}
        if len(fields) == 6:
            seconds = _field(fields.pop(0), 0, 59)
        minute, hour, dom, month, dow = fields
        return cls(
            frozenset(seconds), frozenset(_field(minute, 0, 59)), frozenset(_field(hour, 0, 23)),
            frozenset(_field(month, 1, 12, MONTHS)), dom, dow,
            fixed=not minute.startswith("*") and not hour.startswith("*"),
        )

    def _dom_matches(self, day: date) -> bool:
        last = calendar.monthrange(day.year, day.month)[1]
        for token in self.dom.split(","):
            if token == "L" and day.day == last:
                return True
            if token != "L" and day.day in _atom(token, 1, 31, None):
                return True
        return False

    def _dow_matches(self, day: date) -> bool:
        weekday = (day.weekday() + 1) % 7  # Sunday 0
        for token in self.dow.split(","):
            if "#" in token:
                name, nth = token.split("#")
                wanted = DAYS.index(name.lower()) if name.lower() in DAYS else int(name) % 7
                if weekday == wanted and (day.day - 1) // 7 + 1 == int(nth):
                    return True
            elif weekday in {v % 7 for v in _atom(token, 0, 7, DAYS)}:
                return True
        return False

    def day_matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        # croniter: ``*``/``?`` leaves the other day field alone; two restricted ones are OR-ed.
        dom_any = self.dom in ("*", "?")
        dow_any = self.dow in ("*", "?")
        if dom_any or dow_any:
            return (dom_any or self._dom_matches(day)) and (dow_any or self._dow_matches(day))
        return self._dom_matches(day) or self._dow_matches(day)

    def walls(self, day: date, *, backwards: bool = False) -> Iterator[datetime]:
        """Matching wall times, day by day from ``day`` on (or back)."""
        step = timedelta(days=-1 if backwards else 1)
        for _ in range(366 * 30):
            if self.day_matches(day):
                times = sorted(
                    (h, m, s) for h in self.hours for m in self.minutes for s in self.seconds
                )
                for h, m, s in reversed(times) if backwards else times:
                    yield datetime(day.year, day.month, day.day, h, m, s)
            day += step


def _wall(instant: datetime, zone: ZoneInfo) -> datetime:
    return instant.astimezone(zone).replace(tzinfo=None)


def _instants(wall: datetime, zone: ZoneInfo, fixed: bool) -> list[datetime]:
    """When a wall time runs, found by scanning real time around it (minutes, then seconds)."""
    hits: list[datetime] = []
    probe = wall.replace(tzinfo=UTC) - timedelta(hours=15)
    while probe <= wall.replace(tzinfo=UTC) + timedelta(hours=15):
        if _wall(probe, zone) == wall:
            hits.append(probe)
        probe += timedelta(minutes=15)  # every offset since 1980 is a multiple of 15 min
    if hits:
        return hits[:1] if fixed else hits
    if not fixed:
        return []
    # Missing fixed time: the first instant whose wall time is past it.
    probe = wall.replace(tzinfo=UTC) - timedelta(hours=15)
    while _wall(probe, zone) < wall:
        probe += timedelta(minutes=1)
    # The gap may end between two probes: step back to the exact transition.
    while _wall(probe - timedelta(seconds=1), zone) > wall:
        probe -= timedelta(seconds=1)
    return [probe]


def reference_after(ref: Reference, zone: ZoneInfo, after: datetime, count: int) -> list[datetime]:
    found: set[datetime] = set()
    start = (_wall(after, zone) - timedelta(days=2)).date()
    horizon: datetime | None = None
    for wall in ref.walls(start):
        if horizon is not None and wall > horizon:
            break
        for instant in _instants(wall, zone, ref.fixed):
            if instant > after:
                found.add(instant)
        if len(found) >= count and horizon is None:
            horizon = wall + timedelta(days=2)
    return sorted(found)[:count]


def reference_latest(ref: Reference, zone: ZoneInfo, at: datetime) -> datetime:
    best: datetime | None = None
    start = (_wall(at, zone) + timedelta(days=2)).date()
    horizon: datetime | None = None
    for wall in ref.walls(start, backwards=True):
        if horizon is not None and wall < horizon:
            break
        for instant in _instants(wall, zone, ref.fixed):
            if instant <= at and (best is None or instant > best):
                best = instant
        if best is not None and horizon is None:
            horizon = wall - timedelta(days=2)
    assert best is not None
    return best


# -- random expressions --------------------------------------------------------------------


def _random_field(rng: random.Random, low: int, high: int, names: list[str] | None) -> str:
    def value() -> str:
        v = rng.randint(low, high)
        if names is not None and rng.random() < 0.4:
            return names[v - (1 if names is MONTHS else 0)].upper()
        return str(v)

    kind = rng.choice(["star", "star", "value", "range", "rangestep", "starstep", "list"])
    if kind == "star":
        return "*"
    if kind == "value":
        return value()
    if kind == "starstep":
        return f"*/{rng.randint(2, max(2, (high - low) // 2))}"
    a, b = sorted(rng.sample(range(low, high + 1), 2))
    if kind == "range":
        return f"{a}-{b}"
    if kind == "rangestep":
        return f"{a}-{b}/{rng.randint(1, max(1, b - a))}"
    return ",".join(sorted({value() for _ in range(rng.randint(2, 4))}))


def random_expression(rng: random.Random, seconds: bool) -> str:
    minute = _random_field(rng, 0, 59, None)
    hour = _random_field(rng, 0, 23, None)
    dom = _random_field(rng, 1, 31, None)
    if rng.random() < 0.1:
        dom = rng.choice(["L", "?", "29", "30", "31", "L,15"])
    month = _random_field(rng, 1, 12, MONTHS)
    dow = _random_field(rng, 0, 6, DAYS)
    if rng.random() < 0.1:
        dow = rng.choice(["?", f"{rng.choice(DAYS).upper()}#{rng.randint(1, 5)}"])
        if "#" in dow:
            # croniter ANDs an nth weekday with a restricted day of month (and refuses
            # ``15 * MON#2`` as never firing); keep to what it documents.
            dom = "*"
    if dom == "?" and dow == "?":
        dow = "*"
    # A day field that spells out its whole range (``0-6``, ``1-31``) is left out: croniter
    # treats it now as ``*`` (AND), now as a restriction (OR), depending on the month field.
    if dow not in ("*", "?") and "#" not in dow and {
        v % 7 for v in _field(dow, 0, 7, DAYS)
    } == set(range(7)):
        dow = "*"
    if dom not in ("*", "?") and "L" not in dom and _field(dom, 1, 31) == set(range(1, 32)):
        dom = "*"
    fields = [minute, hour, dom, month, dow]
    if seconds:
        fields.insert(0, rng.choice(["0", "*/20", "15,45", "30", "*/7"]))
    return " ".join(fields)


def _cases(count: int, seed: int) -> list[tuple[str, str, datetime]]:
    rng = random.Random(seed)
    cases: list[tuple[str, str, datetime]] = []
    while len(cases) < count:
        expression = random_expression(rng, seconds=rng.random() < 0.15)
        zone = rng.choice(ZONES)
        offset = timedelta(seconds=rng.randrange(25 * 365 * 86400))
        start = datetime(2010, 1, 1, tzinfo=UTC) + offset
        try:
            check_cron(expression)
        except InvalidOptionError:
            continue  # never fires (e.g. 30 Feb): refused, checked elsewhere
        cases.append((expression, zone, start))
    return cases


#: More cases or another seed locally: PGTASK_CRON_CASES=500 PGTASK_CRON_SEED=7 pytest ...
CASES = _cases(int(os.environ.get("PGTASK_CRON_CASES", "16")),
               seed=int(os.environ.get("PGTASK_CRON_SEED", "20240601")))


@pytest.mark.parametrize(("expression", "zone_name", "start"), CASES)
def test_cron_occurrences_match_an_independent_brute_force_reference(
    expression: str, zone_name: str, start: datetime
) -> None:
    zone = ZoneInfo(zone_name)
    ref = Reference.parse(expression)
    recurrence = Recurrence.of(expression, None, zone_name)
    expected = reference_after(ref, zone, start, 12)
    got: list[datetime] = []
    cursor = start
    for _ in range(len(expected)):
        cursor = recurrence.next_after(cursor)
        got.append(cursor)
    assert got == expected, expression
    for instant in expected[:4]:
        probe = instant + (expected[-1] - instant) * 0.37
        assert recurrence.latest(probe) == reference_latest(ref, zone, probe), (expression, probe)
        assert recurrence.latest(instant) == instant


@pytest.mark.parametrize(
    ("expression", "zone_name", "start"),
    [
        ("30 2 * * *", "America/New_York", datetime(2024, 3, 9, 12, tzinfo=UTC)),
        ("*/20 2 * * *", "America/New_York", datetime(2024, 3, 9, 12, tzinfo=UTC)),
        ("30 1 * * *", "America/New_York", datetime(2024, 11, 2, 12, tzinfo=UTC)),
        ("*/30 1 * * *", "America/New_York", datetime(2024, 11, 2, 12, tzinfo=UTC)),
        ("15 0 * * *", "America/Santiago", datetime(2024, 9, 6, 12, tzinfo=UTC)),
        ("15,45 2 * * *", "Australia/Lord_Howe", datetime(2024, 10, 5, 0, tzinfo=UTC)),
        ("0 0 29 2 *", "Europe/Berlin", datetime(2025, 1, 1, tzinfo=UTC)),
        ("0 12 L 2,4 *", "UTC", datetime(2023, 1, 1, tzinfo=UTC)),
        ("0 9 31 * MON", "UTC", datetime(2023, 1, 1, tzinfo=UTC)),
        ("0 0 * * FRI#5", "Europe/Berlin", datetime(2023, 1, 1, tzinfo=UTC)),
        ("*/20 30 2 * * *", "Europe/Berlin", datetime(2024, 3, 30, 12, tzinfo=UTC)),
    ],
)
def test_cron_edge_cases_match_the_reference(
    expression: str, zone_name: str, start: datetime
) -> None:
    test_cron_occurrences_match_an_independent_brute_force_reference(expression, zone_name, start)


@pytest.mark.parametrize("expression", ["0 0 30 2 *", "0 0 31 4,6,9,11 *", "0 0 31 2 *"])
def test_an_expression_that_never_fires_is_refused(expression: str) -> None:
    with pytest.raises(InvalidOptionError):
        check_cron(expression)


def test_recurrence_error_type_is_exported_for_stored_definitions() -> None:
    with pytest.raises(RecurrenceError):
        Recurrence.of("0 0 30 2 *", None, "UTC").next_after(datetime(2030, 1, 1, tzinfo=UTC))


@pytest.mark.parametrize("expression", ["R R * * *", "0 r(1-5) * * *", "R/5 * * * *",
                                        "0 0 * * R", "0,R 0 * * *", "R 0 0 * * *"])
def test_a_random_expression_is_refused_since_its_occurrences_would_change_on_every_read(
    expression: str,
) -> None:
    # croniter's ``R`` draws a new value every time the expression is parsed: the cursor,
    # the misfire decision and the listed occurrences would each see another schedule.
    with pytest.raises(InvalidOptionError) as raised:
        check_cron(expression)
    assert raised.value.field == "cron"
    with pytest.raises(RecurrenceError):
        Recurrence.of(expression, None, "UTC").next_after(datetime(2030, 1, 1, tzinfo=UTC))
