"""_logging: formats the worker's log records as text or as one JSON object per line; never
decides what is logged.

The worker emits records; this module only shapes them for the process's stderr. In JSON form
every record is one line that a log pipeline can parse without a multi-line rule: a traceback
is a field of the object, not lines after it. The per-task fields the worker attaches with
``extra=`` (`TASK_FIELDS`) become top-level keys when present, so a log query can select "every
record of task X" or "every failed attempt of queue Q" without parsing messages.

Formatting a record must never fail: a value JSON cannot encode (a UUID, a datetime, an
arbitrary object, a non-finite float) is written as text, and a message whose ``%`` arguments
do not match is written as its template and arguments rather than lost.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import uuid
from collections.abc import Mapping
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Final, Literal, get_args

__all__ = [
    "LOG_FORMATS", "TASK_FIELDS", "JsonFormatter", "LogFormat", "configure_logging",
    "escape_controls",
]

#: The two shapes of the worker's log: human-readable lines, or one JSON object per line.
LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = get_args(LogFormat)

#: ``extra`` fields copied into a JSON record when the log call set them.
TASK_FIELDS: Final = (
    "task_id",
    "task_name",
    "version",
    "queue",
    "attempt",
    "duration_seconds",
    "outcome",
    "error_kind",
    "worker_id",
)

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Every control character: C0 (ESC, CR, BEL, newline ...), DEL and C1 (the one-byte CSI).
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f]")

#: How deep nested containers in an extra value are converted before falling back to text.
_MAX_DEPTH: Final = 8


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character written as its JSON escape (``\\u001b``).

    For user data on its way to a log line or a terminal (a handler's error message, a
    payload): raw, it could clear the screen, retitle the window or forge a line of its own.
    The escape is JSON's, and a JSON document holds control characters only inside its
    strings (``json`` leaves DEL and C1 raw with ``ensure_ascii=False``), so a document stays
    valid and its values unchanged.
    """
    return _CONTROL.sub(_escape, text)


def _jsonable(value: object, depth: int = 0) -> Any:
    """``value`` as something `json.dumps` encodes as strict JSON (no NaN, no Infinity)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
        return value.isoformat()
    if isinstance(value, (date, time)):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if depth < _MAX_DEPTH:
        if isinstance(value, Mapping):
            return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [_jsonable(v, depth + 1) for v in value]
    try:
        return str(value)
    except Exception:  # a broken __str__ must not lose the record
        return f"<unprintable {type(value).__name__}>"


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except (TypeError, ValueError):  # the %-arguments do not fit the template
        return f"{record.msg!s} (arguments {record.args!r})"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line.

    Keys: ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message``,
    ``exception`` (the formatted traceback, when the record carries one), ``stack`` (when
    logged with ``stack_info``), and each of `TASK_FIELDS` that the record has.
    """

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, tz=timezone.utc)
        document: dict[str, Any] = {
            "time": created.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _message(record),
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        for field in TASK_FIELDS:
            if field in record.__dict__:
                document[field] = _jsonable(record.__dict__[field])
        return json.dumps(document, ensure_ascii=False, allow_nan=False)


def configure_logging(level: str, fmt: LogFormat) -> None:
    """Send every log record of ``level`` and above to stderr, as ``fmt`` lines.

    Replaces the handlers of the root logger (the command owns the process's logging).
    ``level`` is a level name in any case (``"info"``, ``"WARNING"``).
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
