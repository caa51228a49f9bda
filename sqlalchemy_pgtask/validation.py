"""validation: the naming rules and value limits, checked in Python before any SQL runs.

Pure functions with no I/O. The same limits are CHECK constraints in the schema (see
``models``), so a writer that bypasses this module still cannot store an invalid row; checking
here first gives a typed error and leaves the caller's transaction usable.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Final

from sqlalchemy_pgtask.errors import InvalidNameError, InvalidOptionError, PayloadError

__all__ = [
    "ERROR_MAX_BYTES",
    "HEADERS_MAX_BYTES",
    "IDEMPOTENCY_KEY_MAX_BYTES",
    "NAME_PATTERN",
    "PAYLOAD_MAX_BYTES",
    "QUEUE_NAME_MAX_BYTES",
    "RESULT_MAX_BYTES",
    "TASK_NAME_MAX_BYTES",
    "check_idempotency_key",
    "check_int_range",
    "check_queue_name",
    "check_task_name",
    "dump_headers",
    "dump_json",
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

#: PostgreSQL ``integer`` and ``smallint`` bounds, so an out-of-range option is our error and
#: not a driver overflow in the middle of the caller's transaction.
INT4_MAX: Final = 2**31 - 1
INT2_MIN: Final = -(2**15)
INT2_MAX: Final = 2**15 - 1

_NAME_RE: Final = re.compile(NAME_PATTERN)


@functools.lru_cache(maxsize=4096)
def _name_problem(value: str, max_bytes: int) -> str | None:
    """Why ``value`` is not a valid name, or None. Cached: a batch repeats a few names."""
    if not value:
        return "must not be empty"
    if not _NAME_RE.match(value):
        return f"{value!r} may only contain ASCII letters, digits, '.', '_', ':' and '-'"
    if len(value) > max_bytes:  # ASCII only at this point, so characters are bytes
        return f"is {len(value)} bytes long; the limit is {max_bytes}"
    return None


def _check_name(field: str, value: object, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise InvalidNameError(field, f"must be a str, got {type(value).__name__}")
    problem = _name_problem(value, max_bytes)
    if problem is not None:
        raise InvalidNameError(field, problem)
    return value


def check_queue_name(value: object, field: str = "queue") -> str:
    """Return ``value`` if it is a valid queue name, else raise `InvalidNameError`."""
    return _check_name(field, value, QUEUE_NAME_MAX_BYTES)


def check_task_name(value: object, field: str = "name") -> str:
    """Return ``value`` if it is a valid task name, else raise `InvalidNameError`."""
    return _check_name(field, value, TASK_NAME_MAX_BYTES)


def check_idempotency_key(value: object, field: str = "idempotency_key") -> str:
    """Idempotency keys are free text (they often embed application ids) but bounded."""
    if not isinstance(value, str):
        raise InvalidNameError(field, f"must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidNameError(field, "must not be empty")
    if "\x00" in value:
        raise InvalidNameError(field, "must not contain NUL characters")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > IDEMPOTENCY_KEY_MAX_BYTES:
        raise InvalidNameError(
            field, f"is {size} bytes long; the limit is {IDEMPOTENCY_KEY_MAX_BYTES}"
        )
    return value


def check_int_range(field: str, value: object, low: int, high: int) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(field, f"must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidOptionError(field, f"must be between {low} and {high}, got {value}")
    return value


def check_seconds(field: str, value: object) -> float:
    """A finite, non-negative duration in seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(field, f"must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise InvalidOptionError(field, f"must be finite, got {value!r}")
    if seconds < 0:
        raise InvalidOptionError(field, f"must not be negative, got {value!r}")
    return seconds


def _find_nul(value: Any, path: str) -> str | None:
    """Return the path of the first string holding NUL (PostgreSQL's jsonb rejects it)."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                return f"{path} key {key!r}"
            found = _find_nul(item, f"{path}[{key!r}]")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _find_nul(item, f"{path}[{index}]")
            if found:
                return found
    return None


def dump_json(field: str, value: object, max_bytes: int) -> str:
    """Serialise ``value`` to the JSON text that will be cast to ``jsonb``.

    Uses the same separators as PostgreSQL's jsonb output so the byte count here is the one the
    CHECK constraint measures (``octet_length(value::text)``) for all ordinary values.
    """
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadError(field, f"is not JSON-serialisable: {exc}") from exc
    except RecursionError as exc:
        raise PayloadError(field, "is nested too deeply to serialise") from exc
    # Only a JSON escape can put NUL in the text, so the walk runs only when it is needed.
    if "\\u0000" in text:
        where = _find_nul(value, field)
        if where is not None:
            raise PayloadError(field, f"contains a NUL character at {where}")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise PayloadError(field, f"is {size} bytes as JSON; the limit is {max_bytes}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(field, "contains an unpaired surrogate character") from exc
    return text


def dump_headers(value: object, field: str = "headers") -> str:
    """Headers are a JSON object with string keys (trace context, correlation ids)."""
    if value is None:
        return "{}"
    if not isinstance(value, Mapping):
        raise PayloadError(field, f"must be a mapping (a JSON object), got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise PayloadError(field, f"keys must be str, got {type(key).__name__}")
    return dump_json(field, dict(value), HEADERS_MAX_BYTES)
