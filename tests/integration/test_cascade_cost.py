"""A cascade costs O(subtree): cancelling the root of a deep chain, completing the parent above
it and timing out a wait for it each walk the chain once.

``tasks_cancel_descendants`` was a row trigger that walked the whole subtree below every task
it cancelled, so a chain of n cost n^2/2 visits (a chain of 4,000: 5.7 s to cancel). Each case
here runs under a ``statement_timeout`` the old trigger exceeds by far on a chain of 3,000
(about 3 s on the machine that measured it) and the one-walk cascade meets with a wide margin
(tens of milliseconds; figures in ``benchmarks/cascade.py`` and docs/performance.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, text

from sqlalchemy_pgtask import cancel, retry
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support import durable as d
from tests.support.trees import add_chain, add_tree, states_below

CHAIN = 3000
#: Far above what the one-walk cascade needs, far below what the old trigger took.
BUDGET = "1500ms"


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


@contextlib.contextmanager
def _budget(conn: Connection) -> Iterator[None]:
    """The statements inside run under `BUDGET`; the checks after them do not."""
    conn.execute(text(f"SET statement_timeout = '{BUDGET}'"))
    try:
        yield
    finally:
        conn.execute(text("RESET statement_timeout"))


def _running(conn: Connection, name: str) -> d.Lease:
    d.add_task(conn, name)
    return d.claim_one(conn, name)


def test_cancelling_the_root_of_a_deep_chain_walks_it_once(auto: Connection) -> None:
    root = d.add_task(auto, "root")
    add_chain(auto, root, CHAIN)
    with _budget(auto):
        assert cancel(auto, root) == "cancelled"
    assert states_below(auto, root) == {"cancelled": CHAIN}
    # Times never go back: each descendant completed no earlier than its last change.
    late = auto.execute(
        text("SELECT count(*) FROM pgtask.tasks WHERE completed_at < updated_at")
    ).scalar_one()
    assert late == 0


def test_completing_the_parent_above_a_deep_chain_records_its_outcome(auto: Connection) -> None:
    parent = _running(auto, "parent")
    add_chain(auto, parent.task_id, CHAIN)
    with _budget(auto):
        assert d.complete(auto, parent, "done") == [(parent.task_id, "succeeded")]
    assert states_below(auto, parent.task_id) == {"cancelled": CHAIN}


def test_a_wait_timeout_above_a_deep_chain_is_applied(
    auto: Connection, pgtask_clock: DatabaseClock
) -> None:
    parent = _running(auto, "parent")
    child = d.spawn_child(auto, parent, "ship", "child")
    d.waiting_on_child(auto, parent, "await-ship", child, timeout=60.0)
    add_chain(auto, child, CHAIN)
    pgtask_clock.advance(61)
    with _budget(auto):
        assert d.wait_timeouts(auto) == [parent.task_id]
    assert d.task_of(auto, child)["state"] == "cancelled"
    assert states_below(auto, child) == {"cancelled": CHAIN}


def test_cancelling_the_root_of_a_wide_tree_cancels_every_descendant(auto: Connection) -> None:
    root = d.add_task(auto, "root")
    add_tree(auto, root, 20_000)
    # No time budget: a wide tree cost the old trigger one visit per task as well, so a budget
    # here would only time 20,000 updates (it failed twice that way on a loaded 2-core box).
    assert cancel(auto, root) == "cancelled"
    assert states_below(auto, root) == {"cancelled": 20_000}


def test_a_cascade_still_reaches_below_a_running_task_asked_to_stop(auto: Connection) -> None:
    """A running task only gets a cancel request; the pending tasks below it are cancelled at
    once all the same (the walk goes through it, and stops only at finished tasks)."""
    parent = _running(auto, "parent")
    middle_id = d.spawn_child(auto, parent, "middle", "middle")
    middle = d.claim_one(auto, "middle")
    assert middle.task_id == middle_id
    below = add_chain(auto, middle_id, 3)
    assert cancel(auto, middle_id) == "running"  # a request: nothing below changes yet
    assert states_below(auto, middle_id) == {"pending": 3}
    assert cancel(auto, parent.task_id) == "running"
    assert d.complete(auto, parent, "done") == [(parent.task_id, "cancelled")]
    assert states_below(auto, middle_id) == {"cancelled": 3}
    assert d.task_of(auto, middle_id)["state"] == "running"
    assert {d.task_of(auto, task)["error"]["ancestor_id"] for task in below} == {
        str(parent.task_id)
    }


def test_a_cascade_reaches_a_retried_task_below_a_finished_one(auto: Connection) -> None:
    """``retry()`` makes a task below a finished one outstanding again: cancelling an ancestor
    above the finished one must still reach it (the walk goes through finished tasks)."""
    root = d.add_task(auto, "root")
    middle, leaf = add_chain(auto, root, 2)
    assert cancel(auto, middle) == "cancelled"  # and, by the cascade, the leaf below it
    assert d.task_of(auto, leaf)["state"] == "cancelled"
    retry(auto, leaf)
    assert d.task_of(auto, leaf)["state"] == "pending"
    with _budget(auto):
        assert cancel(auto, root) == "cancelled"
    assert d.task_of(auto, leaf)["state"] == "cancelled"
    assert d.task_of(auto, leaf)["error"]["ancestor_id"] == str(root)
