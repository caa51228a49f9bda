"""``pgtask schedule run-now NAME`` as an operator runs it: one occurrence enqueued now from the
schedule's template, the task's id printed, a ``schedule.run_now`` audit entry with the actor
and reason; an unknown schedule is one error line and writes nothing."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import Engine, func, select

from sqlalchemy_pgtask import set_schedule
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.models import AuditEntry, Task
from tests.acceptance.test_cli_admin import _error
from tests.support.workerproc import lines, run_cli


def test_run_now_prints_the_task_and_audits_it(
    pgtask_database_url: str, pgtask_engine: Engine, tmp_path: Path
) -> None:
    with pgtask_engine.begin() as connection:
        cursor = set_schedule(connection, "nightly", task="report", cron="0 3 * * *",
                              timezone="Europe/Berlin", queue="reports",
                              payload={"kind": "daily"}).next_run_at

    result = run_cli("schedule", "run-now", "nightly", "--actor", "ops", "--reason",
                     "late data", "--database-url", pgtask_database_url, cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    [line] = lines(result.stdout)
    found = re.fullmatch(r"schedule nightly: task ([0-9a-f-]{36}) enqueued now", line)
    assert found is not None, line
    with pgtask_engine.connect() as connection:
        task = connection.execute(select(Task).where(Task.schedule_name == "nightly")).one()
        [entry] = list_audit(connection, schedule="nightly", limit=1)
        next_run = connection.scalar(select(func.min(Task.run_at)))
    assert str(task.id) == found.group(1)
    assert (task.name, task.queue, task.payload) == ("report", "reports", {"kind": "daily"})
    assert next_run is not None
    assert next_run < cursor  # due now, not at the next occurrence
    assert (entry.action, entry.actor, entry.reason) == ("schedule.run_now", "ops", "late data")
    assert entry.task_id == task.id
    help_text = " ".join(run_cli("schedule", "--help", cwd=tmp_path).stdout.split())
    assert "run-now" in help_text


def test_run_now_of_an_unknown_schedule_is_one_error_line_and_writes_nothing(
    pgtask_database_url: str, pgtask_engine: Engine, tmp_path: Path
) -> None:
    result = run_cli("schedule", "run-now", "missing", "--database-url", pgtask_database_url,
                     cwd=tmp_path)

    assert "no schedule named 'missing'" in _error(result, 1)
    with pgtask_engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(Task)) == 0
        assert connection.scalar(select(func.count()).select_from(AuditEntry)) == 0
