"""validation: the naming rules and value limits, checked in Python before any SQL runs.

Pure functions with no I/O. The same limits are CHECK constraints in the schema (see
``models``), so a writer that bypasses this module still cannot store an invalid row; checking
here first gives a typed error and leaves the caller's transaction usable.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Final

from sqlalchemy_pgtask._defaults import SCHEDULE_HEADER
from sqlalchemy_pgtask._json_text import (
    encode,
    find_nul,
    has_exponent,
    jsonb_text_size,
    scalar_text,
)
from sqlalchemy_pgtask.errors import InvalidNameError, InvalidOptionError, PayloadError

__all__ = [
    "CHECKPOINT_MAX_BYTES",
    "CONCURRENCY_KEY_MAX_BYTES",
    "CONCURRENCY_SCOPES",
    "DURATION_MAX_SECONDS",
    "ERROR_MAX_BYTES",
    "HEADERS_MAX_BYTES",
    "IDEMPOTENCY_KEY_MAX_BYTES",
    "NAME_PATTERN",
    "PAYLOAD_MAX_BYTES",
    "QUEUE_NAME_MAX_BYTES",
    "RESULT_MAX_BYTES",
    "SIGNAL_MAX_BYTES",
    "STEP_NAME_MAX_BYTES",
    "TASK_NAME_MAX_BYTES",
    "check_concurrency",
    "check_concurrency_key",
    "check_concurrency_scope",
    "check_delay",
    "check_free_text",
    "check_idempotency_key",
    "check_int_range",
    "check_poll_interval",
    "check_queue_name",
    "check_run_at",
    "check_seconds",
    "check_step_name",
    "check_task_name",
    "check_time_limit",
    "check_timeout",
    "dump_headers",
    "dump_json",
    "jsonb_text_size",
]

#: Names of queues and tasks: ASCII letters, digits and ``. _ : -``; the same regex is a CHECK.
NAME_PATTERN: Final = r"^[A-Za-z0-9._:-]+$"
QUEUE_NAME_MAX_BYTES: Final = 128
TASK_NAME_MAX_BYTES: Final = 255
IDEMPOTENCY_KEY_MAX_BYTES: Final = 512
PAYLOAD_MAX_BYTES: Final = 1024 * 1024
RESULT_MAX_BYTES: Final = 1024 * 1024
HEADERS_MAX_BYTES: Final = 64 * 1024
ERROR_MAX_BYTES: Final = 256 * 1024
CHECKPOINT_MAX_BYTES: Final = 1024 * 1024
SIGNAL_MAX_BYTES: Final = 1024 * 1024
STEP_NAME_MAX_BYTES: Final = 255
CONCURRENCY_KEY_MAX_BYTES: Final = 512
#: What a definition's concurrency key is held through: its whole workflow (durable
#: suspensions included), or only while an attempt runs.
CONCURRENCY_SCOPES: Final = ("workflow", "running")

#: PostgreSQL ``integer`` and ``smallint`` bounds, so an out-of-range option is our error and
#: not a driver overflow in the middle of the caller's transaction.
INT4_MAX: Final = 2**31 - 1
INT2_MIN: Final = -(2**15)
INT2_MAX: Final = 2**15 - 1

#: The longest duration the library accepts: enqueue delays, retry delays and caps, and queue
#: retention settings. One hundred (Julian) years is far beyond any real schedule, yet keeps
#: every deadline computed from it (``statement_timestamp() + make_interval(secs => ...)``,
#: by the enqueue, the worker's retries and the key-expiry trigger) inside what PostgreSQL's
#: ``interval`` and ``timestamptz`` can hold and what Python's `datetime` can read back
#: (years 1 to 9999). Without a bound, a huge value is accepted here and overflows later, in
#: the worker or a trigger, far from the mistake.
DURATION_MAX_SECONDS: Final = 36525 * 24 * 3600  # 100 years of 365.25 days

_TOO_LONG: Final = f"must be at most {DURATION_MAX_SECONDS} seconds (100 years)"

# NAME_PATTERN is also a POSIX regex in a CHECK; in Python ``$`` also matches before a final
# newline, so the Python check matches the whole string instead.
_NAME_RE: Final = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))


@functools.lru_cache(maxsize=4096)
def _name_problem(value: str, max_bytes: int) -> str | None:
    """Why ``value`` is not a valid name, or None. Cached: a batch repeats a few names."""
    if not value:
        return "must not be empty"
    if not _NAME_RE.fullmatch(value):
        return f"{value!r} may only contain ASCII letters, digits, '.', '_', ':' and '-'"
    if len(value) > max_bytes:  # ASCII only at this point, so characters are bytes
        return f"is {len(value)} bytes long; the limit is {max_bytes}"
    return None


def _check_name(field: str, value: object, max_bytes: int) -> str:
    if type(value) is str and (value, max_bytes) in _VALID_NAMES:
        return value
    if not isinstance(value, str):
        raise InvalidNameError(field, f"must be a str, got {type(value).__name__}")
    problem = _name_problem(value, max_bytes)
    if problem is not None:
        raise InvalidNameError(field, problem)
    if type(value) is str and len(_VALID_NAMES) < _VALID_NAMES_MAX:
        _VALID_NAMES.add((value, max_bytes))
    return value


#: Names already found valid (a process uses a few task and queue names over and over), so a
#: bulk enqueue matches the pattern once per distinct name. Bounded: names made up per call
#: (a mistake, but possible) stop being remembered rather than grow it without end.
_VALID_NAMES: Final[set[tuple[str, int]]] = set()
_VALID_NAMES_MAX: Final = 4096


def check_queue_name(value: object, field: str = "queue") -> str:
    """Return ``value`` if it is a valid queue name, else raise `InvalidNameError`."""
    return _check_name(field, value, QUEUE_NAME_MAX_BYTES)


def check_task_name(value: object, field: str = "name") -> str:
    """Return ``value`` if it is a valid task name, else raise `InvalidNameError`."""
    return _check_name(field, value, TASK_NAME_MAX_BYTES)


def check_idempotency_key(value: object, field: str = "idempotency_key") -> str:
    """Idempotency keys are free text (they often embed application ids) but bounded."""
    return check_free_text(field, value, IDEMPOTENCY_KEY_MAX_BYTES)


def check_step_name(value: object, field: str = "step") -> str:
    """Step names are free text (``f"charge-{order_id}"``) but bounded, like keys."""
    return check_free_text(field, value, STEP_NAME_MAX_BYTES)


def check_concurrency_key(value: object, field: str = "concurrency_key") -> str:
    """Concurrency keys are free text (``f"customer-{id}"``), bounded like idempotency keys."""
    return check_free_text(field, value, CONCURRENCY_KEY_MAX_BYTES)


def check_concurrency(
    key: object, limit: object, prefix: str = ""
) -> tuple[str | None, int | None]:
    """A task's (or a schedule's) key and limit: a limit needs a key."""
    checked_key = None if key is None else check_concurrency_key(key, f"{prefix}concurrency_key")
    if limit is None:
        return checked_key, None
    checked = check_int_range(f"{prefix}concurrency_limit", limit, 1, INT4_MAX)
    if checked_key is None:
        raise InvalidOptionError(
            f"{prefix}concurrency_limit", "needs a concurrency_key: a limit applies per key"
        )
    return checked_key, checked


def check_concurrency_scope(value: object, field: str = "concurrency_scope") -> str:
    if not isinstance(value, str) or value not in CONCURRENCY_SCOPES:
        raise InvalidOptionError(
            field, f"must be one of {', '.join(map(repr, CONCURRENCY_SCOPES))}, got {value!r}"
        )
    return value


def check_free_text(field: str, value: object, max_bytes: int) -> str:
    """Non-empty text without NUL, valid UTF-8, at most ``max_bytes`` bytes."""
    if not isinstance(value, str):
        raise InvalidNameError(field, f"must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidNameError(field, "must not be empty")
    if "\x00" in value:
        raise InvalidNameError(field, "must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # A lone surrogate cannot be sent as UTF-8: the driver would fail mid-transaction.
        raise InvalidNameError(
            field, f"is not valid UTF-8 (unpaired surrogate at index {exc.start})"
        ) from exc
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        raise InvalidNameError(field, f"is {size} bytes long; the limit is {max_bytes}")
    return value


def check_int_range(field: str, value: object, low: int, high: int) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(field, f"must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidOptionError(field, f"must be between {low} and {high}, got {value}")
    return value


def check_seconds(field: str, value: object) -> float:
    """A finite, non-negative duration in seconds, at most `DURATION_MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(field, f"must be a number of seconds, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError as exc:  # an int beyond any float
        raise InvalidOptionError(field, _TOO_LONG) from exc
    if not math.isfinite(seconds):
        raise InvalidOptionError(field, f"must be finite, got {value!r}")
    if seconds < 0:
        raise InvalidOptionError(field, f"must not be negative, got {value!r}")
    if seconds > DURATION_MAX_SECONDS:
        raise InvalidOptionError(field, f"{_TOO_LONG}, got {value!r}")
    return seconds


def check_delay(field: str, value: object) -> float:
    """A delay from now, as seconds or a `timedelta`, within `DURATION_MAX_SECONDS`."""
    if isinstance(value, timedelta):
        return check_seconds(field, value.total_seconds())
    return check_seconds(field, value)


def check_run_at(field: str, value: object) -> datetime:
    """A timezone-aware `datetime` whose UTC value Python can read back (years 1 to 9999), as
    that UTC value.

    PostgreSQL stores instants from 4713 BC, so ``datetime(1, 1, 1, tzinfo=+05:00)`` (year 0
    in UTC) would be written, and every later read of the task would fail in the driver.
    In UTC because two instants of one zone's repeated hour (``fold``) compare equal in
    Python, and PostgreSQL's text input refuses offsets Python allows (16 hours or more, or
    with fractions of a second) where a statement or ``COPY`` sends the value as text.
    """
    if not isinstance(value, datetime):
        raise InvalidOptionError(field, f"must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidOptionError(field, "must be timezone-aware (a naive datetime is ambiguous)")
    try:
        return value.astimezone(timezone.utc)
    except OverflowError as exc:
        raise InvalidOptionError(
            field, f"{value.isoformat()} is outside years 1 to 9999 in UTC"
        ) from exc


def check_timeout(field: str, value: object) -> float | None:
    """How long a waiter may wait: None or ``inf`` for ever, else a non-negative number.

    NaN is refused: it compares false with everything, so a deadline built from it would
    never expire.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(field, f"must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise InvalidOptionError(field, f"must be a non-negative number or None, got {value!r}")
    return seconds


def check_time_limit(field: str, value: object) -> float | None:
    """An attempt's time limit: None (no limit), or a positive number of seconds or
    `timedelta` within `DURATION_MAX_SECONDS`."""
    if value is None:
        return None
    seconds = check_delay(field, value)
    if seconds <= 0:
        raise InvalidOptionError(field, f"must be positive (or None for no limit), got {value!r}")
    return seconds


def check_poll_interval(field: str, value: object) -> float:
    """How often a waiter re-reads: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(field, f"must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidOptionError(field, f"must be a positive, finite number, got {value!r}")
    return seconds


def dump_json(field: str, value: object, max_bytes: int) -> str:
    """Serialise ``value`` to the JSON text that will be cast to ``jsonb``.

    Uses the same separators as PostgreSQL's jsonb output, and counts the size as the CHECK
    constraint will (``octet_length(value::text)``, floats in exponent form written out in
    full), so a value accepted here is never rejected by the database.
    """
    try:
        scalar = scalar_text(value)
        text = encode(value) if scalar is None else scalar
    except (TypeError, ValueError) as exc:
        raise PayloadError(field, f"is not JSON-serialisable: {exc}") from exc
    except RecursionError as exc:
        raise PayloadError(field, "is nested too deeply to serialise") from exc
    if scalar is not None:
        size = jsonb_text_size(scalar) if "e" in scalar else len(scalar)
        if size > max_bytes:
            raise PayloadError(field, f"is {size} bytes as jsonb text; the limit is {max_bytes}")
        return scalar
    # Only a JSON escape can put NUL in the text, so the walk runs only when it is needed.
    if "\\u0000" in text:
        try:
            where = find_nul(value, field)
        except RecursionError as exc:
            # The walk takes a Python frame per level where the C encoder took none, so a
            # value the encoder could write may still be too deep for it.
            raise PayloadError(
                field, "contains a NUL character, nested too deeply to say where"
            ) from exc
        if where is not None:
            raise PayloadError(field, f"contains a NUL character at {where}")
    surrogate: UnicodeEncodeError | None = None
    if text.isascii():  # most payloads: one byte per character, no surrogate possible
        size = len(text)
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            surrogate = exc
            size = len(text.encode("utf-8", "surrogatepass"))
    if has_exponent(text):
        size = jsonb_text_size(text)
    # Too large is reported before an unpaired surrogate: the size is the first thing a caller
    # with a bad payload needs to hear about, and it was reported first before the fast path.
    if size > max_bytes:
        raise PayloadError(field, f"is {size} bytes as jsonb text; the limit is {max_bytes}")
    if surrogate is not None:
        raise PayloadError(field, "contains an unpaired surrogate character") from surrogate
    return text


def dump_headers(
    value: object, field: str = "headers", max_bytes: int = HEADERS_MAX_BYTES
) -> str:
    """Headers are a JSON object with string keys (trace context, correlation ids); the
    library's own `SCHEDULE_HEADER` is refused, so a task's occurrence is never forged."""
    if value is None:
        return "{}"
    if not isinstance(value, Mapping):
        raise PayloadError(field, f"must be a mapping (a JSON object), got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise PayloadError(field, f"keys must be str, got {type(key).__name__}")
    if SCHEDULE_HEADER in value:
        raise PayloadError(
            field, f"{SCHEDULE_HEADER!r} is reserved: schedules set it on their tasks"
        )
    return dump_json(field, dict(value), max_bytes)
