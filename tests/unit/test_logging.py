"""The worker's log formats: one strict JSON object per line, whatever the record carries.

No database. The records are built the way the worker's ``logger.info(..., extra={...})`` and
``logger.exception(...)`` build them, and go through a real handler of the root logger.
"""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

from sqlalchemy_pgtask._logging import TASK_FIELDS, JsonFormatter, configure_logging


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, restored after the test (configure_logging replaces its handlers)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield root
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def _capture(logger: logging.Logger) -> io.StringIO:
    """Point the handler configure_logging installed at a buffer instead of stderr."""
    [handler] = logging.getLogger().handlers
    assert isinstance(handler, logging.StreamHandler)
    buffer = io.StringIO()
    handler.setStream(buffer)
    return buffer


def _records(buffer: io.StringIO) -> list[dict[str, Any]]:
    lines = buffer.getvalue().splitlines()
    return [json.loads(line) for line in lines]


def test_json_record_has_time_level_logger_message_and_the_task_fields(
    root_logger: logging.Logger,
) -> None:
    configure_logging("info", "json")
    buffer = _capture(root_logger)
    task_id, worker_id = uuid.uuid4(), uuid.uuid4()

    logging.getLogger("sqlalchemy_pgtask.worker").info(
        "task %s finished", task_id,
        extra={
            "task_id": task_id, "task_name": "send-receipt", "version": 2, "queue": "emails",
            "attempt": 3, "duration_seconds": 0.25, "outcome": "succeeded",
            "error_kind": None, "worker_id": worker_id, "unrelated": "not copied",
        },
    )

    [record] = _records(buffer)
    assert record.pop("time").endswith("+00:00")
    assert record == {
        "level": "INFO",
        "logger": "sqlalchemy_pgtask.worker",
        "message": f"task {task_id} finished",
        "task_id": str(task_id),
        "task_name": "send-receipt",
        "version": 2,
        "queue": "emails",
        "attempt": 3,
        "duration_seconds": 0.25,
        "outcome": "succeeded",
        "error_kind": None,
        "worker_id": str(worker_id),
    }


def test_time_is_iso_8601_in_utc() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    record.created = datetime(2024, 5, 1, 12, 0, 0, 123000, tzinfo=timezone.utc).timestamp()

    document = json.loads(JsonFormatter().format(record))

    assert document["time"] == "2024-05-01T12:00:00.123+00:00"
    assert datetime.fromisoformat(document["time"]).utcoffset() == timedelta(0)


def test_a_record_without_extras_has_only_the_base_keys(root_logger: logging.Logger) -> None:
    configure_logging("info", "json")
    buffer = _capture(root_logger)

    logging.getLogger("app").warning("plain")

    [record] = _records(buffer)
    assert set(record) == {"time", "level", "logger", "message"}
    assert not set(record) & set(TASK_FIELDS)


def test_an_exception_is_one_field_of_one_line(root_logger: logging.Logger) -> None:
    configure_logging("info", "json")
    buffer = _capture(root_logger)

    try:
        raise RuntimeError("the mailer is down")
    except RuntimeError:
        logging.getLogger("sqlalchemy_pgtask.worker").exception(
            "claim failed", extra={"worker_id": "w-1"}
        )

    assert len(buffer.getvalue().splitlines()) == 1
    [record] = _records(buffer)
    assert record["level"] == "ERROR"
    assert record["message"] == "claim failed"
    assert record["exception"].startswith("Traceback (most recent call last):")
    assert record["exception"].rstrip().endswith("RuntimeError: the mailer is down")
    assert record["worker_id"] == "w-1"


class _Opaque:
    def __str__(self) -> str:
        return "opaque thing"


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON (Python's json module accepts it)")


def test_values_json_cannot_encode_are_written_as_text() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    when = datetime(2024, 5, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    extras: dict[str, Any] = {
        "task_id": uuid.UUID(int=1),
        "task_name": _Opaque(),
        "version": Decimal("2"),
        "queue": _Unprintable(),
        "attempt": {"when": when, "ids": (uuid.UUID(int=2),), 3: 2},
        "duration_seconds": float("nan"),
        "outcome": float("inf"),
        "error_kind": b"bytes",
        "worker_id": timedelta(seconds=1.5),
    }
    record.__dict__.update(extras)

    line = JsonFormatter().format(record)

    document = json.loads(line, parse_constant=_not_json)
    assert document["task_id"] == "00000000-0000-0000-0000-000000000001"
    assert document["task_name"] == "opaque thing"
    assert document["version"] == "2"
    assert document["queue"] == "<unprintable _Unprintable>"
    assert document["attempt"] == {
        "when": "2024-05-01T12:00:00+00:00",
        "ids": ["00000000-0000-0000-0000-000000000002"],
        "3": 2,
    }
    assert document["duration_seconds"] == "nan"
    assert document["outcome"] == "inf"
    assert document["error_kind"] == "b'bytes'"
    assert document["worker_id"] == 1.5


def test_a_message_whose_arguments_do_not_fit_is_kept() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%d tasks", ("many",), None)

    document = json.loads(JsonFormatter().format(record))

    assert document["message"] == "%d tasks (arguments ('many',))"


def test_text_format_is_one_readable_line(root_logger: logging.Logger) -> None:
    configure_logging("WARNING", "text")
    buffer = _capture(root_logger)

    logging.getLogger("app").info("hidden")
    logging.getLogger("app").warning("shown %d", 1)

    [line] = buffer.getvalue().splitlines()
    assert line.endswith(" WARNING app: shown 1")
    assert root_logger.level == logging.WARNING


def test_an_unknown_format_is_refused(root_logger: logging.Logger) -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml")  # type: ignore[arg-type]
