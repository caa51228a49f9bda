"""A task's times agree with its attempts': no attempt finishes after its task completed.

Statement-level, over several connections to a real PostgreSQL: a ``cancel()`` whose statement
began before the attempt's suspension, and had to wait for the task row that suspension held.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, select

from sqlalchemy_pgtask import Task, cancel
from tests.support import durable as d
from tests.support.tasks import read_attempts, read_task


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def test_a_task_cancelled_while_its_attempt_suspends_completes_after_the_attempt_finished(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = d.add_task(auto)
    lease = d.claim_one(auto)
    with pgtask_engine.connect() as sleeper:
        # The suspension holds the task row (here from before its statement, as its own
        # statement holds it once it got it first) ...
        sleeper.execute(select(Task.id).where(Task.id == task_id).with_for_update(key_share=True))
        # ... while a cancel, whose statement (and statement time) began earlier, waits.
        cancelling = d.Blocked(pgtask_engine, auto, lambda conn: cancel(conn, task_id))
        assert d.sleep(sleeper, lease, "nap", delay=60.0).suspended
        sleeper.commit()
    assert cancelling.result() == "cancelled"

    task = read_task(auto, task_id)
    (attempt,) = read_attempts(auto, task_id)
    assert (task["state"], attempt["state"]) == ("cancelled", "suspended")
    # The cancel found the task pending only after the attempt had finished: it completed
    # then, not at its own statement's start (which was earlier).
    assert task["completed_at"] >= attempt["finished_at"]
    assert task["updated_at"] >= attempt["finished_at"]
