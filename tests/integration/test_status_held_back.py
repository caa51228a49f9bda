"""``pgtask status`` names work a background pass should have handled and has not.

A worker sets a held wait aside in its own memory; status reads the consequence from the
database instead: a due wait timeout still waiting, an expired lease still running, overdue by
more than `status.HELD_BACK_AFTER`. The held row is a real row lock from another connection;
database time is moved, never slept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, text

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support import durable as d
from tests.support.workerproc import cli_env, run_cli


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def test_a_wait_timeout_a_held_row_keeps_from_being_applied_is_shown_held_back(
    auto: Connection, pgtask_engine: Engine, pgtask_clock: DatabaseClock,
    pgtask_database_url: str, tmp_path: Path,
) -> None:
    d.add_task(auto, "held")
    lease = d.claim_one(auto, "held")
    d.waiting_on_signal(auto, lease, "approval", "go", timeout=2.0)
    d.make_wait_due(auto, lease.task_id)
    # Just due is normal (the next pass applies it): not held back yet.
    assert status.held_back(auto) == []
    with pgtask_engine.connect() as holder:
        holder.execute(
            text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE"), {"id": lease.task_id}
        )
        auto.execute(text("SET lock_timeout = '200ms'"))
        pgtask_clock.advance(status.HELD_BACK_AFTER + 30)
        assert d.wait_timeouts(auto) == []  # the pass skips the held wait
        (held,) = status.held_back(auto)
        assert (held.kind, held.count, held.oldest_task_id) == ("wait_timeout", 1, lease.task_id)
        assert held.oldest_overdue_seconds > status.HELD_BACK_AFTER
        assert held.message.startswith(f"1 wait timeout overdue (oldest task {lease.task_id}, ")
        assert held.message.endswith(f"see `pgtask explain {lease.task_id}`)")

        env = cli_env({"PGTASK_DATABASE_URL": pgtask_database_url})
        result = run_cli("status", cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        (line,) = [x for x in result.stdout.splitlines() if x.startswith("held back:")]
        assert line.startswith(f"held back: 1 wait timeout overdue (oldest task {lease.task_id}, ")
        assert line.endswith(f" s; see `pgtask explain {lease.task_id}`)")
        holder.rollback()
    assert d.wait_timeouts(auto) == [lease.task_id]  # released: applied, and no longer shown
    assert status.held_back(auto) == []


def test_an_expired_lease_not_recovered_is_shown_held_back_until_recovery_runs(
    auto: Connection, pgtask_clock: DatabaseClock
) -> None:
    d.add_task(auto, "a")
    d.add_task(auto, "b")
    first, second = d.claim_one(auto, "a"), d.claim_one(auto, "b")
    d.expire_lease(auto, first.task_id)
    assert status.held_back(auto) == []
    pgtask_clock.advance(status.HELD_BACK_AFTER + 5)
    d.expire_lease(auto, second.task_id)  # expired 1 s ago: not overdue
    (held,) = status.held_back(auto)
    assert (held.kind, held.count, held.oldest_task_id) == ("expired_lease", 1, first.task_id)
    assert held.message.startswith("1 expired lease overdue")
    assert [h.count for h in status.held_back(auto, after=0)] == [2]
    d.recover(auto)
    assert status.held_back(auto, after=0) == []


def test_the_bound_must_not_be_negative(auto: Connection) -> None:
    with pytest.raises(ValueError, match="after must be >= 0"):
        status.held_back(auto, after=-1)
