"""What ``pgtask task show``, ``task list`` and ``status`` print for edge cases; no database.

The common paths run end to end in ``tests/acceptance/test_cli.py``; these cover the error
documents the worker writes without a traceback, documents that are not objects, and times
in other zones.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy_pgtask.cli._render import (
    printable,
    status_lines,
    task_detail_json,
    task_detail_lines,
    task_list_lines,
    when,
)
from sqlalchemy_pgtask.status import (
    AttemptInfo,
    HeldBack,
    QueueStatus,
    TaskDetail,
    TaskSummary,
)

NOW = datetime(2024, 5, 1, 14, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
TASK_ID = uuid.UUID("0190f6c1-7d2e-7c41-9a55-3f1e0e8b9a10")
WORKER_ID = uuid.UUID(int=7)


def _task(**changes: Any) -> TaskDetail:
    fields: dict[str, Any] = {
        "id": TASK_ID, "queue": "default", "name": "job", "version": 1, "state": "failed",
        "priority": 0, "attempt": 1, "max_attempts": 1, "run_at": NOW, "created_at": NOW,
        "updated_at": NOW, "completed_at": NOW, "failed_attempts": 1, "payload": "hello",
        "headers": {}, "result": None, "error": None, "idempotency_key": None,
        "parent_id": None, "lease_owner": None, "lease_expires_at": None,
        "cancel_requested_at": None, "retry_kind": "exponential", "retry_base_seconds": 1.0,
        "retry_factor": 2.0, "retry_max_seconds": 300.0, "retry_jitter": True, "attempts": (),
    }
    fields.update(changes)
    return TaskDetail(**fields)


def test_times_are_shown_in_utc_to_the_millisecond() -> None:
    assert when(NOW) == "2024-05-01T12:00:00.123Z"
    assert when(None) == "-"


def test_scalar_documents_are_json_on_the_fields_line() -> None:
    out = task_detail_lines(_task(payload="hello", headers={}, result=[1]))

    assert "  payload: \"hello\"" in out
    assert "  headers: {}" in out
    assert out[out.index("  result:") + 1:out.index("  result:") + 4] == [
        "    [", "      1", "    ]",
    ]
    assert "  retry: exponential, base 1s, factor 2, max 300s, jitter" in out
    assert "  completed_at: 2024-05-01T12:00:00.123Z" in out


def test_an_error_without_a_traceback_shows_its_kind_and_fields() -> None:
    error = {"type": "result_rejected", "reason": "not JSON serialisable: set"}
    out = task_detail_lines(_task(error=error))

    at = out.index("  error: result_rejected")
    assert out[at + 1] == "    reason: not JSON serialisable: set"
    assert out[-1] == "attempts: none"


def test_a_multi_line_message_is_one_line_in_summaries_and_the_traceback_keeps_its_lines() -> None:
    error = {
        "type": "handler_error", "exception": "app.MailerDown", "message": "down\nfor now",
        "traceback": (
            'Traceback (most recent call last):\n  File "x.py", line 1\n'
            "app.MailerDown: down\nfor now\n"
        ),
        "traceback_truncated": True,
    }
    attempt = AttemptInfo(
        attempt=1, state="failed", worker_id=WORKER_ID, started_at=NOW,
        finished_at=NOW + timedelta(seconds=1.5), error=error,
    )
    out = task_detail_lines(_task(error=error, attempts=(attempt,)))

    at = out.index("  error: handler_error: app.MailerDown: down for now")
    assert out[at + 1:at + 6] == [
        "    traceback_truncated: True",
        "    Traceback (most recent call last):",
        '      File "x.py", line 1',
        "    app.MailerDown: down",
        "    for now",
    ]
    assert out[-2:] == [
        f"  attempt 1: failed by worker {WORKER_ID}, started 2024-05-01T12:00:00.123Z, "
        "finished 2024-05-01T12:00:01.623Z (1.500s)",
        "    handler_error: app.MailerDown: down for now",
    ]


def test_the_json_document_keeps_offsets_and_writes_uuids_as_strings() -> None:
    attempt = AttemptInfo(1, "lost", None, NOW, None, {"type": "lease_expired"})
    document = json.loads(task_detail_json(_task(attempts=(attempt,))))

    assert document["task"]["id"] == str(TASK_ID)
    assert document["task"]["created_at"] == "2024-05-01T14:00:00.123456+02:00"
    assert document["task"]["payload"] == "hello"
    assert "attempts" not in document["task"]
    assert document["attempts"] == [{
        "attempt": 1, "state": "lost", "worker_id": None,
        "started_at": "2024-05-01T14:00:00.123456+02:00", "finished_at": None,
        "error": {"type": "lease_expired"},
    }]


def test_task_list_aligns_columns_and_offers_the_next_page_only_when_full() -> None:
    summary = TaskSummary(
        id=TASK_ID, queue="a-long-queue-name", name="job", version=2, state="pending",
        priority=0, attempt=0, max_attempts=5, run_at=NOW, created_at=NOW, updated_at=NOW,
        completed_at=None,
    )
    full = task_list_lines([summary], limit=1)
    assert full[0].index("QUEUE") == full[1].index("a-long-queue-name")
    assert full[0].index("STATE") == full[1].index("pending")
    assert full[-1] == f"(first 1; older ones: add --before {TASK_ID})"
    assert len(task_list_lines([summary], limit=2)) == 2
    assert task_list_lines([], limit=2) == ["no tasks match"]


def test_status_without_workers_or_queues() -> None:
    assert status_lines([], [], []) == ["live workers: 0", "queues: none has settings or tasks"]
    queue = QueueStatus(
        name="q", configured=True, paused_at=None, max_outstanding_tasks=None,
        outstanding_tasks=None, pending=0, due=0, running=0, waiting=0, succeeded=1, failed=0,
        cancelled=0,
    )
    assert status_lines([], [queue], [])[2:] == [
        "  q: 0 pending (0 due), 0 running, 0 waiting",
        "    finished: 1 succeeded, 0 failed, 0 cancelled; capacity unlimited; not paused",
    ]


def test_status_names_the_oldest_task_of_work_held_back() -> None:
    held = [
        HeldBack("wait_timeout", 2, TASK_ID, 34.4),
        HeldBack("expired_lease", 1000, WORKER_ID, 61.0),
    ]
    assert status_lines([], [], [], held)[2:] == [
        f"held back: 2 wait timeouts overdue (oldest task {TASK_ID}, 34 s;"
        f" see `pgtask explain {TASK_ID}`)",
        f"held back: 1000+ expired leases overdue (oldest task {WORKER_ID}, 61 s;"
        f" see `pgtask explain {WORKER_ID}`)",
    ]


def test_printable_escapes_every_control_character_and_keeps_json_its_value() -> None:
    hostile = "a\x1b]0;t\x07\x1b[2J\r\n\t\x00\x7f\x9b31mb é ☃"
    assert printable(hostile) == (
        "a\\u001b]0;t\\u0007\\u001b[2J\\u000d\\u000a\\u0009\\u0000\\u007f\\u009b31mb é ☃"
    )
    document = task_detail_json(_task(payload={"m": hostile}, error={"message": hostile}))
    escaped = printable(document)
    assert not any(0x7F <= ord(c) <= 0x9F or ord(c) < 0x20 for c in escaped)
    assert json.loads(escaped) == json.loads(document)
