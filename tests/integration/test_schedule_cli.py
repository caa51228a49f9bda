"""``pgtask schedule list|set|pause|resume|delete``, run as a subprocess like an operator would:
what it prints, what it changes (with audit entries), and one-line errors."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from sqlalchemy_pgtask.models import AuditEntry
from sqlalchemy_pgtask.schedule import get_schedule
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support.workerproc import lines, run_cli

UTC = timezone.utc
T0 = datetime(2030, 6, 3, 10, 0, 30, tzinfo=UTC)


def test_set_list_pause_resume_and_delete(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_clock: DatabaseClock, tmp_path: Path
) -> None:
    pgtask_clock.set_offset((T0 - datetime.now(UTC)).total_seconds())
    url = ("--database-url", pgtask_database_url)
    assert lines(run_cli("schedule", "list", *url, cwd=tmp_path).stdout) == ["no schedules"]

    made = run_cli(
        "schedule", "set", "nightly", "--task", "report", "--cron", "0 3 * * *",
        "--timezone", "Europe/Berlin", "--queue", "reports", "--payload", '{"kind": "daily"}',
        "--misfire", "catch_up", "--catch-up-limit", "3", "--overlap", "skip",
        "--actor", "ops", *url, cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    assert lines(made.stdout)[0] == (
        "nightly: cron '0 3 * * *' Europe/Berlin -> report v1 on reports"
        " [active, misfire=catch_up(limit 3), overlap=skip]"
    )
    every = run_cli("schedule", "set", "pulse", "--task", "ping", "--every", "90", *url,
                    cwd=tmp_path)
    assert every.returncode == 0, every.stderr

    listed = lines(run_cli("schedule", "list", "--upcoming", "2", *url, cwd=tmp_path).stdout)
    assert listed[0].startswith("nightly: ")
    # 03:00 in Berlin (CEST, UTC+2) is 01:00 UTC, the next day.
    assert listed[1].startswith("  next run: 2030-06-04T01:00:00.000Z")
    assert listed[2] == "  upcoming: 2030-06-04T01:00:00.000Z, 2030-06-05T01:00:00.000Z"
    assert listed[3].startswith("pulse: every 90s -> ping v1 on default [active, misfire=latest")

    paused = run_cli("schedule", "pause", "nightly", "--actor", "ops", "--reason", "freeze",
                     *url, cwd=tmp_path)
    assert paused.returncode == 0, paused.stderr
    assert "[paused," in lines(paused.stdout)[0]
    resumed = run_cli("schedule", "resume", "nightly", *url, cwd=tmp_path)
    assert "[active," in lines(resumed.stdout)[0]
    deleted = run_cli("schedule", "delete", "pulse", "--reason", "retired", *url, cwd=tmp_path)
    assert lines(deleted.stdout) == ["schedule pulse deleted (its tasks are kept)"]

    with Session(pgtask_engine) as session:
        assert get_schedule(session, "pulse") is None
        info = get_schedule(session, "nightly")
        audit = session.execute(
            select(AuditEntry.action, AuditEntry.actor, AuditEntry.reason, AuditEntry.schedule)
            .order_by(AuditEntry.id)
        ).all()
    assert info is not None
    assert (info.payload, info.queue, info.paused) == ({"kind": "daily"}, "reports", False)
    assert [tuple(row) for row in audit] == [
        ("schedule.set", "ops", None, "nightly"),
        ("schedule.set", "postgres", None, "pulse"),
        ("schedule.pause", "ops", "freeze", "nightly"),
        ("schedule.resume", "postgres", None, "nightly"),
        ("schedule.delete", "postgres", "retired", "pulse"),
    ]


def test_mistakes_are_one_line_errors(pgtask_database_url: str, tmp_path: Path) -> None:
    url = ("--database-url", pgtask_database_url)
    for args, code, text in [
        (("set", "x", "--task", "t", "--cron", "61 * * * *"), 2, "cron"),
        (("set", "x", "--task", "t", "--cron", "* * * * *", "--timezone", "Nowhere/City"), 2,
         "unknown time zone"),
        (("set", "x", "--task", "t", "--every", "0.5"), 2, "every"),
        (("set", "x", "--task", "t", "--cron", "* * * * *", "--payload", "{nope"), 2, "JSON"),
        (("set", "x", "--task", "t"), 2, "--cron"),
        (("pause", "missing"), 1, "no schedule named 'missing'"),
        (("delete", "missing"), 1, "no schedule named 'missing'"),
    ]:
        result = run_cli("schedule", *args, *url, cwd=tmp_path)
        assert result.returncode == code, (args, result.stderr)
        assert "Traceback" not in result.stderr
        [line] = lines(result.stderr)
        assert text in line, (args, line)
