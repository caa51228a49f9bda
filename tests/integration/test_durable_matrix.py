"""Statement-level proofs of the durable rows of the transition matrix (docs/failure-model.md).

Rows: write checkpoint, sleep, register signal wait, register child-result wait, child-result
timeout, parent terminal transition, emit signal. For each row a test injects a failure
**before** the transition's COMMIT (the client rolls back, or its backend is killed with
``pg_terminate_backend`` from another connection, so the COMMIT never arrives) and one
**after** it (the transaction commits, then its connection dies: the client cannot know the
outcome), and shows the matrix's column for each, then its recovery column.

Each test runs the compiled statements of ``sqlalchemy_pgtask.statements`` with the
parameters the worker binds, in the worker's transactions (``tests.support.durable``), over
several connections to a real PostgreSQL. Leases expire and timeouts fall due by moving
timestamps or the clock of the database (``pgtask_clock``), never by sleeping; a statement
that must wait for a lock runs in a thread until PostgreSQL reports it waiting
(`tests.support.durable.Blocked`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.testing import DatabaseClock
from sqlalchemy_pgtask.worker._maintenance import WaitTimeouts
from tests.support import durable as d
from tests.support.durable import Failure, Lease
from tests.support.tasks import read_attempts

FAILURES: Final[tuple[Failure, ...]] = ("rollback", "terminate")
TIMED_OUT: Final = {"state": "timeout", "result": None, "error": None}


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    """An autocommit connection, as the worker uses: every statement commits on its own."""
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


@pytest.fixture
def killer(pgtask_engine: Engine) -> Iterator[Connection]:
    """Another autocommit connection: it kills backends and looks at uncommitted work."""
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def running(conn: Connection, name: str = "job", **options: Any) -> Lease:
    """A task that is running attempt 1 (with its lease)."""
    task_id = d.add_task(conn, name, **options)
    lease = d.claim_one(conn, name)
    assert lease.task_id == task_id
    return lease


def reclaimed(conn: Connection, lease: Lease) -> Lease:
    """The lease expires (in database time), recovery returns the task, a new attempt runs."""
    d.expire_lease(conn, lease.task_id)
    assert d.recover(conn) == [(lease.task_id, "pending")]
    again = d.claim_one(conn, d.task_of(conn, lease.task_id)["name"])
    assert (again.task_id, again.attempt) == (lease.task_id, lease.attempt + 1)
    return again


def assert_suspended(
    conn: Connection, lease: Lease, state: str, failed: int = 0
) -> dict[str, Any]:
    """The attempt ended ``suspended``, its lease is gone, and the suspension counted no
    failure (``failed``: the failed attempts before it, such as a lost one)."""
    task = d.task_of(conn, lease.task_id)
    assert task["state"] == state
    assert (task["lease_token"], task["lease_owner"], task["lease_expires_at"]) == (
        None, None, None,
    )
    assert (task["attempt"], task["failed_attempts"]) == (lease.attempt, failed)
    attempt = read_attempts(conn, lease.task_id)[-1]
    assert (attempt["attempt"], attempt["state"]) == (lease.attempt, "suspended")
    assert attempt["finished_at"] == task["updated_at"]
    return task


def assert_holds(conn: Connection, lease: Lease) -> None:
    """The attempt still runs with its lease, as before the failed transition."""
    task = d.task_of(conn, lease.task_id)
    assert (task["state"], task["attempt"], task["lease_token"]) == (
        "running", lease.attempt, lease.token,
    )
    assert read_attempts(conn, lease.task_id)[-1]["state"] == "running"


# -- write checkpoint ------------------------------------------------------------------------


@pytest.mark.parametrize("failure", FAILURES)
def test_checkpoint_failure_before_commit_leaves_the_step_absent_and_it_runs_again(
    pgtask_engine: Engine, auto: Connection, killer: Connection, failure: Failure
) -> None:
    lease = running(auto)
    before = d.snapshot(auto, lease.task_id)
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        assert tuple(d.save_checkpoint(conn, lease, "charge", {"ref": "first"})) == (True, True)
        assert d.checkpoints_of(killer, lease.task_id) == {}  # not committed
    # Failure before commit: the step remains absent, the attempt keeps its lease.
    assert d.snapshot(auto, lease.task_id) == before
    # Recovery: the step runs again (this attempt, whose lease holds) and its result is stored.
    assert tuple(d.save_checkpoint(auto, lease, "charge", {"ref": "second"})) == (True, True)
    assert d.checkpoints_of(auto, lease.task_id) == {("charge", 0): ("step", {"ref": "second"})}


def test_checkpoint_failure_before_commit_then_lease_expiry_runs_the_step_again(
    pgtask_engine: Engine, auto: Connection, killer: Connection
) -> None:
    # The worker died with its checkpoint uncommitted: the next attempt replays nothing.
    lease = running(auto)
    with d.killed_before_commit(pgtask_engine, killer) as conn:
        d.save_checkpoint(conn, lease, "charge", {"ref": "lost"})
    second = reclaimed(auto, lease)
    assert d.replay(auto, lease.task_id) == {}
    assert tuple(d.save_checkpoint(auto, second, "charge", {"ref": "again"})) == (True, True)
    assert d.replay(auto, lease.task_id) == {("charge", 0): ("step", {"ref": "again"})}


def test_checkpoint_failure_after_commit_keeps_the_step_and_the_next_attempt_replays_it(
    pgtask_engine: Engine, auto: Connection, killer: Connection
) -> None:
    lease = running(auto)
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        assert tuple(d.save_checkpoint(conn, lease, "charge", {"ref": "first"})) == (True, True)
    stored = {("charge", 0): ("step", {"ref": "first"})}
    # Failure after commit: the step result is durable; the attempt keeps its lease.
    assert d.checkpoints_of(auto, lease.task_id) == stored
    assert_holds(auto, lease)
    # The worker does not know the outcome and sends the write again: the first committed
    # value wins, and CHECKPOINT returns it.
    assert tuple(d.save_checkpoint(auto, lease, "charge", {"ref": "retry"})) == (True, False)
    assert tuple(d.read_checkpoint(auto, lease.task_id, "charge") or ()) == (
        "step", {"ref": "first"},
    )
    # Recovery after a crash: the next attempt replays the stored value (CHECKPOINTS), and
    # its own write of the same step cannot change it.
    second = reclaimed(auto, lease)
    assert d.replay(auto, lease.task_id) == stored
    assert tuple(d.save_checkpoint(auto, second, "charge", {"ref": "third"})) == (True, False)
    assert d.checkpoints_of(auto, lease.task_id) == stored


def test_a_checkpoint_write_holds_the_lease_until_it_commits(
    pgtask_engine: Engine, auto: Connection, killer: Connection
) -> None:
    lease = running(auto)
    d.expire_lease(auto, lease.task_id)  # expired, not yet recovered: the token still fences
    with pgtask_engine.connect() as conn:
        assert tuple(d.save_checkpoint(conn, lease, "charge", 1)) == (True, True)
        # The write locks the attempt's row: recovery, which ends the attempt, waits for the
        # checkpoint to commit rather than take the lease away from under it.
        recovering = d.Blocked(pgtask_engine, killer, d.recover)
        conn.commit()
    assert recovering.result() == [(lease.task_id, "pending")]
    assert d.replay(auto, lease.task_id) == {("charge", 0): ("step", 1)}


@pytest.mark.parametrize("first_try", ["commits", "rolls back"])
def test_two_tries_of_one_checkpoint_keep_the_first_committed_value(
    pgtask_engine: Engine, auto: Connection, killer: Connection, first_try: str
) -> None:
    # The same call sent twice (its first outcome unknown): the second waits for the first.
    lease = running(auto)
    with pgtask_engine.connect() as first:
        assert tuple(d.save_checkpoint(first, lease, "charge", "one")) == (True, True)
        second = d.Blocked(
            pgtask_engine, killer,
            lambda conn: tuple(d.save_checkpoint(conn, lease, "charge", "two")),
        )
        if first_try == "commits":
            first.commit()
            assert second.result() == (True, False)
            expected = "one"
        else:
            first.rollback()
            assert second.result() == (True, True)
            expected = "two"
    assert d.checkpoints_of(auto, lease.task_id) == {("charge", 0): ("step", expected)}


def test_a_stale_attempt_writes_no_checkpoint_sleep_spawn_or_wait(auto: Connection) -> None:
    stale = running(auto)
    current = reclaimed(auto, stale)
    child = d.spawn_child(auto, current, "spawn")
    d.emit(auto, stale.task_id, "go", "value")
    counted = auto.execute(text("SELECT count(*) FROM pgtask.tasks")).scalar_one()
    before = d.snapshot(auto, stale.task_id, child)

    def nothing_written_by(lease: Lease) -> None:
        assert tuple(d.save_checkpoint(auto, lease, "charge", 1)) == (False, False)
        assert tuple(d.sleep(auto, lease, "nap", delay=60.0)) == (False, None, False)
        assert tuple(d.spawn(auto, lease, "spawn-2")) == (False, None, False)
        assert d.register_signal_wait(auto, lease, "approval", "go") is None
        assert d.register_result_wait(auto, lease, "await", child) is None
        # The registrations are fenced on their own too, without the lock before them.
        waits = {"signal": "go", "signal_occurrence": 0, "timeout": None, "child_id": child}
        for statement in (st.REGISTER_SIGNAL_WAIT, st.REGISTER_RESULT_WAIT):
            row = auto.execute(statement, {**d.params(lease, "await"), **waits}).one()
            assert tuple(row) == (False, None, False)
        assert d.snapshot(auto, stale.task_id, child) == before
        assert auto.execute(text("SELECT count(*) FROM pgtask.tasks")).scalar_one() == counted

    nothing_written_by(stale)
    # The current attempt writes; once it suspended, its own lease writes nothing either.
    assert tuple(d.save_checkpoint(auto, current, "charge", 2)) == (True, True)
    assert d.sleep(auto, current, "nap", delay=60.0).suspended
    before = d.snapshot(auto, stale.task_id, child)
    nothing_written_by(current)


# -- sleep -----------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", FAILURES)
def test_sleep_failure_before_commit_leaves_the_task_running_until_its_lease_expires(
    pgtask_engine: Engine, auto: Connection, killer: Connection, failure: Failure
) -> None:
    lease = running(auto)
    before = d.snapshot(auto, lease.task_id)
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        row = d.sleep(conn, lease, "nap", delay=60.0)
        assert row.held
        assert row.suspended
        assert d.task_of(killer, lease.task_id)["state"] == "running"
    # Failure before commit: the task remains running with its lease; no checkpoint.
    assert d.snapshot(auto, lease.task_id) == before
    # Recovery: lease expiry. The next attempt finds no sleep recorded and sleeps again.
    second = reclaimed(auto, lease)
    assert d.replay(auto, lease.task_id) == {}
    assert d.sleep(auto, second, "nap", delay=60.0).suspended
    assert_suspended(auto, second, "pending", failed=1)  # the lost attempt 1 counted


def test_sleep_failure_after_commit_leaves_the_task_pending_until_the_wake_time(
    pgtask_engine: Engine, auto: Connection, killer: Connection, pgtask_clock: DatabaseClock
) -> None:
    lease = running(auto)
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        row = d.sleep(conn, lease, "nap", delay=60.0)
        assert row.held
        assert row.suspended
    wake_at: datetime = row.wake_at
    # Failure after commit: the task is pending at the wake time; the attempt is suspended.
    task = assert_suspended(auto, lease, "pending")
    assert task["run_at"] == wake_at
    [(kind, value)] = d.checkpoints_of(auto, lease.task_id).values()
    assert kind == "sleep"
    assert datetime.fromisoformat(value["wake_at"]) == wake_at
    # The worker, not knowing the outcome, sends the sleep again: the fence finds no running
    # attempt, and FENCE_STATE tells it its first try committed.
    assert tuple(d.sleep(auto, lease, "nap", delay=60.0)) == (False, None, False)
    fence = auto.execute(st.FENCE_STATE, {"task": lease.task_id}).one()
    assert tuple(fence) == ("pending", lease.attempt, None, False)
    # Recovery: a later claim, once database time reaches the wake time (and not before).
    assert d.claim(auto) == []
    assert d.recover(auto) == []
    pgtask_clock.advance(61)
    second = d.claim_one(auto)
    assert second.attempt == 2
    # The replay returns the stored sleep; sent again, it keeps the first wake time and no
    # longer suspends.
    assert d.replay(auto, lease.task_id) == d.checkpoints_of(auto, lease.task_id)
    again = d.sleep(auto, second, "nap", delay=60.0)
    assert (again.held, again.wake_at, again.suspended) == (True, wake_at, False)
    assert_holds(auto, second)


def test_a_sleep_writes_nothing_once_cancellation_was_requested(auto: Connection) -> None:
    lease = running(auto)
    assert d.cancel_task(auto, lease.task_id) == "running"
    before = d.snapshot(auto, lease.task_id)
    assert tuple(d.sleep(auto, lease, "nap", delay=60.0)) == (False, None, False)
    assert d.snapshot(auto, lease.task_id) == before
    fence = auto.execute(st.FENCE_STATE, {"task": lease.task_id}).one()
    assert tuple(fence) == ("running", lease.attempt, lease.token, True)


# -- register signal wait --------------------------------------------------------------------


@pytest.mark.parametrize("failure", FAILURES)
def test_signal_wait_failure_before_commit_leaves_the_task_running_until_its_lease_expires(
    pgtask_engine: Engine, auto: Connection, killer: Connection, failure: Failure
) -> None:
    lease = running(auto)
    before = d.snapshot(auto, lease.task_id)
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        row = d.register_signal_wait(conn, lease, "approval", "go", timeout=60.0)
        assert row is not None
        assert (row.held, row.value, row.waiting) == (True, None, True)
    # Failure before commit: the task remains running, no wait exists.
    assert d.snapshot(auto, lease.task_id) == before
    d.make_wait_due(auto, lease.task_id)
    assert d.wait_timeouts(auto) == []
    # Recovery: lease expiry; the next attempt registers the wait again.
    second = reclaimed(auto, lease)
    d.waiting_on_signal(auto, second, "approval", "go")
    assert_suspended(auto, second, "waiting", failed=1)  # the lost attempt 1 counted


def test_signal_wait_failure_after_commit_leaves_the_task_waiting_until_the_signal(
    pgtask_engine: Engine, auto: Connection, killer: Connection
) -> None:
    lease = running(auto)
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        d.waiting_on_signal(conn, lease, "approval", "go", signal_occurrence=2)
    # Failure after commit: the task is waiting, with its wait, and holds no lease.
    assert_suspended(auto, lease, "waiting")
    wait = d.wait_of(auto, lease.task_id)
    assert wait is not None
    assert (wait["kind"], wait["step"], wait["occurrence"], wait["version"]) == (
        "signal", "approval", 0, d.VERSION,
    )
    assert (wait["signal_name"], wait["signal_occurrence"], wait["child_id"]) == ("go", 2, None)
    assert wait["timeout_at"] is None
    assert d.checkpoints_of(auto, lease.task_id) == {}
    # Nothing claims, recovers or times it out; the attempt's retry finds its lease gone.
    assert d.claim(auto) == []
    assert d.recover(auto) == []
    assert d.wait_timeouts(auto) == []
    assert d.register_signal_wait(auto, lease, "approval", "go", signal_occurrence=2) is None
    # Recovery: another occurrence of the signal does not wake it; its own does, in the
    # emitter's transaction.
    d.emit(auto, lease.task_id, "go", "not this one", occurrence=0)
    assert d.task_of(auto, lease.task_id)["state"] == "waiting"
    d.emit(auto, lease.task_id, "go", {"approved": True}, occurrence=2)
    task = d.task_of(auto, lease.task_id)
    assert (task["state"], task["run_at"], task["failed_attempts"]) == (
        "pending", task["updated_at"], 0,
    )
    assert d.wait_of(auto, lease.task_id) is None
    stored = {("approval", 0): ("signal", {"signal": {"approved": True}})}
    assert d.checkpoints_of(auto, lease.task_id) == stored
    second = d.claim_one(auto)
    assert second.attempt == 2
    assert d.replay(auto, lease.task_id) == stored


@pytest.mark.parametrize("registration", ["commits", "rolls back"])
def test_a_signal_emitted_while_its_wait_is_registered_waits_for_the_registration(
    pgtask_engine: Engine, auto: Connection, killer: Connection, registration: str
) -> None:
    lease = running(auto)
    with pgtask_engine.connect() as conn:
        d.waiting_on_signal(conn, lease, "approval", "go")
        # The signal's foreign key waits for the task row that LOCK_FOR_WAIT holds.
        emitter = d.Blocked(pgtask_engine, killer, lambda c: d.emit(c, lease.task_id, "go", 7))
        if registration == "commits":
            conn.commit()
        else:
            conn.rollback()
    assert emitter.result() == 7
    if registration == "commits":
        # Its trigger saw the committed wait and woke the task.
        assert d.task_of(auto, lease.task_id)["state"] == "pending"
    else:
        # Only stored; the attempt, still running, finds it when it registers again.
        assert_holds(auto, lease)
        assert d.checkpoints_of(auto, lease.task_id) == {}
        again = d.register_signal_wait(auto, lease, "approval", "go")
        assert again is not None
        assert (again.held, again.value, again.waiting) == (True, {"signal": 7}, False)
        assert_holds(auto, lease)
    assert d.wait_of(auto, lease.task_id) is None
    assert d.checkpoints_of(auto, lease.task_id) == {("approval", 0): ("signal", {"signal": 7})}


@pytest.mark.parametrize("emitter", ["commits", "rolls back"])
def test_a_wait_registered_while_its_signal_is_emitted_waits_for_the_signal(
    pgtask_engine: Engine, auto: Connection, killer: Connection, emitter: str
) -> None:
    lease = running(auto)
    with pgtask_engine.connect() as conn:
        assert d.emit(conn, lease.task_id, "go", 7) == 7
        # LOCK_FOR_WAIT waits for the key-share lock of the signal's foreign key.
        registering = d.Blocked(
            pgtask_engine, killer,
            lambda c: d.register_signal_wait(c, lease, "approval", "go"),
        )
        if emitter == "commits":
            conn.commit()
        else:
            conn.rollback()
    row = registering.result()
    assert row is not None
    assert row.held
    if emitter == "commits":
        # A fresh snapshot after the lock: the registration finds the signal, no suspension.
        assert (row.value, row.waiting) == ({"signal": 7}, False)
        assert_holds(auto, lease)
        assert d.checkpoints_of(auto, lease.task_id) == {
            ("approval", 0): ("signal", {"signal": 7})
        }
    else:
        assert (row.value, row.waiting) == (None, True)
        assert_suspended(auto, lease, "waiting")
        assert d.signals_of(auto, lease.task_id) == {}


# -- register child-result wait --------------------------------------------------------------


@pytest.mark.parametrize("failure", FAILURES)
def test_result_wait_failure_before_commit_leaves_the_parent_running(
    pgtask_engine: Engine, auto: Connection, killer: Connection, failure: Failure
) -> None:
    lease = running(auto, "parent")
    child = d.spawn_child(auto, lease, "ship")
    before = d.snapshot(auto, lease.task_id)
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        row = d.register_result_wait(conn, lease, "await-ship", child, timeout=60.0)
        assert row is not None
        assert (row.held, row.value, row.waiting) == (True, None, True)
    # Failure before commit: the parent remains running; nothing waits for the child.
    assert d.snapshot(auto, lease.task_id) == before
    # The child ends meanwhile: with no wait, the parent is not touched.
    child_lease = d.claim_one(auto, "child")
    assert d.complete(auto, child_lease, {"tracking": "T1"}) == [(child, "succeeded")]
    assert d.snapshot(auto, lease.task_id) == before
    # Recovery: lease expiry; the next attempt replays the spawn and, waiting again, finds the
    # child's result at once.
    second = reclaimed(auto, lease)
    assert d.replay(auto, lease.task_id) == {("ship", 0): ("spawn", {"task_id": str(child)})}
    row = d.register_result_wait(auto, second, "await-ship", child)
    assert row is not None
    outcome = {"state": "succeeded", "result": {"tracking": "T1"}, "error": None}
    assert (row.held, row.value, row.waiting) == (True, outcome, False)
    assert_holds(auto, second)


@pytest.mark.parametrize("ending", ["succeeded", "failed", "cancelled"])
def test_result_wait_failure_after_commit_leaves_the_parent_waiting_until_the_child_ends(
    pgtask_engine: Engine, auto: Connection, killer: Connection, ending: str
) -> None:
    lease = running(auto, "parent")
    child = d.spawn_child(auto, lease, "ship")
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        d.waiting_on_child(conn, lease, "await-ship", child)
    # Failure after commit: the parent is waiting for its direct child.
    assert_suspended(auto, lease, "waiting")
    wait = d.wait_of(auto, lease.task_id)
    assert wait is not None
    assert (wait["kind"], wait["step"], wait["child_id"], wait["signal_name"]) == (
        "child", "await-ship", child, None,
    )
    assert d.claim(auto, "parent") == []
    assert d.recover(auto) == []
    # Recovery: the child's end wakes the parent with the child's state, result and error.
    if ending == "succeeded":
        assert d.complete(auto, d.claim_one(auto, "child"), {"tracking": "T1"})
    elif ending == "failed":
        assert d.fail(auto, d.claim_one(auto, "child"), delay=None)
    else:
        assert d.cancel_task(auto, child) == "cancelled"
    finished = d.task_of(auto, child)
    assert finished["state"] == ending
    parent = d.task_of(auto, lease.task_id)
    assert (parent["state"], parent["run_at"]) == ("pending", parent["updated_at"])
    assert d.wait_of(auto, lease.task_id) is None
    outcome = {"state": ending, "result": finished["result"], "error": finished["error"]}
    assert d.checkpoints_of(auto, lease.task_id)["await-ship", 0] == ("result", outcome)
    assert d.claim_one(auto, "parent").attempt == 2
    assert d.replay(auto, lease.task_id)["await-ship", 0] == ("result", outcome)


@pytest.mark.parametrize("registration", ["commits", "rolls back"])
def test_a_child_finishing_while_its_result_wait_is_registered_is_written_after_it(
    pgtask_engine: Engine, auto: Connection, registration: str
) -> None:
    lease = running(auto, "parent")
    child = d.spawn_child(auto, lease, "ship")
    child_lease = d.claim_one(auto, "child")
    with pgtask_engine.connect() as conn:
        d.waiting_on_child(conn, lease, "await-ship", child)
        # LOCK_CHILD holds the child's row: its COMPLETE skips it instead of waiting.
        assert d.complete(auto, child_lease, "done") == []
        if registration == "commits":
            conn.commit()
        else:
            conn.rollback()
    assert d.complete(auto, child_lease, "done") == [(child, "succeeded")]
    outcome = {"state": "succeeded", "result": "done", "error": None}
    if registration == "commits":
        assert d.task_of(auto, lease.task_id)["state"] == "pending"
        assert d.checkpoints_of(auto, lease.task_id)["await-ship", 0] == ("result", outcome)
    else:
        assert_holds(auto, lease)
        assert ("await-ship", 0) not in d.checkpoints_of(auto, lease.task_id)
    assert d.wait_of(auto, lease.task_id) is None


@pytest.mark.parametrize("completion", ["commits", "rolls back"])
def test_a_result_wait_registered_while_the_child_finishes_waits_for_the_child(
    pgtask_engine: Engine, auto: Connection, killer: Connection, completion: str
) -> None:
    lease = running(auto, "parent")
    child = d.spawn_child(auto, lease, "ship")
    child_lease = d.claim_one(auto, "child")
    with pgtask_engine.connect() as conn:
        assert d.complete(conn, child_lease, "done") == [(child, "succeeded")]
        # LOCK_CHILD waits for the completion's row lock.
        registering = d.Blocked(
            pgtask_engine, killer,
            lambda c: d.register_result_wait(c, lease, "await-ship", child),
        )
        if completion == "commits":
            conn.commit()
        else:
            conn.rollback()
    row = registering.result()
    assert row is not None
    assert row.held
    if completion == "commits":
        outcome = {"state": "succeeded", "result": "done", "error": None}
        assert (row.value, row.waiting) == (outcome, False)
        assert_holds(auto, lease)
        assert d.checkpoints_of(auto, lease.task_id)["await-ship", 0] == ("result", outcome)
    else:
        assert (row.value, row.waiting) == (None, True)
        assert_suspended(auto, lease, "waiting")
        # The child's end, written later, wakes the parent.
        assert d.complete(auto, child_lease, "later") == [(child, "succeeded")]
        assert d.task_of(auto, lease.task_id)["state"] == "pending"


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_child_cancelled_in_a_snapshot_isolation_transaction_wakes_its_waiting_parent(
    pgtask_engine: Engine, auto: Connection, isolation: str
) -> None:
    # Under a snapshot isolation the child's trigger cannot see a wait registered after the
    # snapshot; it locks the parent instead, whose row the registration changed: the cancel
    # fails with a serialization error, and the application's retry sees the wait.
    lease = running(auto, "parent")
    child = d.spawn_child(auto, lease, "ship")
    with pgtask_engine.execution_options(isolation_level=isolation).connect() as app:
        app.execute(text("SELECT 1"))  # the application's transaction has read something
        d.waiting_on_child(auto, lease, "await-ship", child)
        with pytest.raises(OperationalError) as raised:
            d.cancel_task(app, child)
        assert getattr(raised.value.orig, "sqlstate", None) == "40001"
        app.rollback()
        assert d.task_of(auto, child)["state"] == "pending"
        assert d.cancel_task(app, child) == "cancelled"  # the retry, with a new snapshot
        app.commit()
    assert d.task_of(auto, child)["state"] == "cancelled"
    # The child's end committed, so its parent must not be waiting any more.
    assert d.task_of(auto, lease.task_id)["state"] == "pending"
    assert d.wait_of(auto, lease.task_id) is None
    assert d.checkpoints_of(auto, lease.task_id)["await-ship", 0][1]["state"] == "cancelled"


# -- child-result timeout --------------------------------------------------------------------


@dataclass(frozen=True)
class TimedTree:
    """A parent waiting (timeout 60 s) for its child, which waits for a signal and has two
    children of its own: one pending, one running."""

    parent: Lease
    child: Lease
    pending: uuid.UUID
    running: Lease


def timed_tree(conn: Connection) -> TimedTree:
    parent = running(conn, "parent")
    child_id = d.spawn_child(conn, parent, "ship")
    d.waiting_on_child(conn, parent, "await-ship", child_id, timeout=60.0)
    child = d.claim_one(conn, "child")
    pending = d.spawn_child(conn, child, "label", "pending-grandchild")
    d.spawn_child(conn, child, "pack", "running-grandchild")
    runner = d.claim_one(conn, "running-grandchild")
    d.waiting_on_signal(conn, child, "approval", "go")
    return TimedTree(parent, child, pending, runner)


def tree_ids(tree: TimedTree) -> list[uuid.UUID]:
    return [tree.parent.task_id, tree.child.task_id, tree.pending, tree.running.task_id]


@pytest.mark.parametrize("failure", FAILURES)
def test_child_timeout_failure_before_commit_leaves_parent_and_child_unchanged(
    pgtask_engine: Engine, auto: Connection, killer: Connection, pgtask_clock: DatabaseClock,
    failure: Failure,
) -> None:
    tree = timed_tree(auto)
    pgtask_clock.advance(61)
    before = d.snapshot(auto, *tree_ids(tree))
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        assert d.wait_timeouts(conn) == [tree.parent.task_id]
    # Failure before commit: parent, child and the child's subtree remain unchanged.
    assert d.snapshot(auto, *tree_ids(tree)) == before
    # Recovery: the next pass times the wait out.
    assert d.wait_timeouts(auto) == [tree.parent.task_id]


def test_child_timeout_after_commit_wakes_the_parent_and_cancels_the_child_subtree(
    pgtask_engine: Engine, auto: Connection, killer: Connection, pgtask_clock: DatabaseClock
) -> None:
    tree = timed_tree(auto)
    parent_id, child_id = tree.parent.task_id, tree.child.task_id
    assert d.wait_timeouts(auto) == []  # not due yet
    pgtask_clock.advance(61)
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        assert d.wait_timeouts(conn) == [parent_id]
    # Failure after commit: the parent is pending with the timeout as its checkpoint...
    parent = d.task_of(auto, parent_id)
    assert (parent["state"], parent["run_at"], parent["failed_attempts"]) == (
        "pending", parent["updated_at"], 0,
    )
    assert d.wait_of(auto, parent_id) is None
    assert d.checkpoints_of(auto, parent_id)["await-ship", 0] == ("result", TIMED_OUT)
    # ...and the child subtree is cancelled: the child (waiting) and its pending child at
    # once, its running child by a cancel request.
    timed_out = {"type": "cancelled", "reason": "result_wait_timeout", "waiter_id": str(parent_id)}
    child = d.task_of(auto, child_id)
    assert child["state"] == "cancelled"
    assert child["error"] == timed_out
    assert d.wait_of(auto, child_id) is None
    pending = d.task_of(auto, tree.pending)
    assert pending["state"] == "cancelled"
    assert pending["error"] == timed_out
    runner = d.task_of(auto, tree.running.task_id)
    assert runner["state"] == "running"
    assert runner["cancel_requested_at"] is not None
    assert d.wait_timeouts(auto) == []
    # Nothing late changes it: the running grandchild's success is recorded as cancelled,
    # and a signal to the cancelled child is only stored.
    assert d.complete(auto, tree.running, "late") == [(tree.running.task_id, "cancelled")]
    d.emit(auto, child_id, "go", "late")
    assert d.task_of(auto, child_id)["state"] == "cancelled"
    assert ("approval", 0) not in d.checkpoints_of(auto, child_id)
    # Recovery: the parent replays the timeout checkpoint; waiting again for the (now
    # cancelled) child returns the stored timeout, the first committed value.
    second = d.claim_one(auto, "parent")
    assert second.attempt == 2
    assert d.replay(auto, parent_id)["await-ship", 0] == ("result", TIMED_OUT)
    row = d.register_result_wait(auto, second, "await-ship", child_id)
    assert row is not None
    assert (row.held, row.value, row.waiting) == (True, TIMED_OUT, False)


@pytest.fixture
def waiting_for_running_child(auto: Connection) -> tuple[Lease, Lease]:
    """A parent waiting for its running child, the wait's timeout due."""
    parent = running(auto, "parent")
    child_id = d.spawn_child(auto, parent, "ship")
    d.waiting_on_child(auto, parent, "await-ship", child_id, timeout=60.0)
    child = d.claim_one(auto, "child")
    d.make_wait_due(auto, parent.task_id)
    auto.execute(text("SET lock_timeout = '10s'"))  # a statement that waited would fail
    return parent, child


def test_a_timeout_pass_leaves_a_parent_to_its_child_that_is_finishing(
    pgtask_engine: Engine, auto: Connection, waiting_for_running_child: tuple[Lease, Lease]
) -> None:
    parent, child = waiting_for_running_child
    with pgtask_engine.connect() as conn:
        # The completion locks the child, then its trigger locks and wakes the parent.
        assert d.complete(conn, child, "done") == [(child.task_id, "succeeded")]
        assert d.wait_timeouts(auto) == []  # skipped, not waited for
        conn.commit()
    outcome = {"state": "succeeded", "result": "done", "error": None}
    assert d.checkpoints_of(auto, parent.task_id)["await-ship", 0] == ("result", outcome)
    assert d.task_of(auto, parent.task_id)["state"] == "pending"
    assert d.wait_timeouts(auto) == []


def test_a_child_finishing_during_a_timeout_pass_ends_cancelled(
    pgtask_engine: Engine, auto: Connection, waiting_for_running_child: tuple[Lease, Lease]
) -> None:
    parent, child = waiting_for_running_child
    with pgtask_engine.connect() as conn:
        assert d.wait_timeouts(conn) == [parent.task_id]
        assert d.complete(auto, child, "done") == []  # skipped while the pass holds it
        conn.commit()
    assert d.complete_until_written(auto, child, "done") == ("cancelled", 0)
    assert d.checkpoints_of(auto, parent.task_id)["await-ship", 0] == ("result", TIMED_OUT)
    finished = d.task_of(auto, child.task_id)
    assert (finished["result"], finished["error"]) == (None, {"type": "cancelled"})


def test_a_timeout_pass_does_not_wait_for_a_childs_open_transaction(
    pgtask_engine: Engine, auto: Connection, waiting_for_running_child: tuple[Lease, Lease]
) -> None:
    parent, child = waiting_for_running_child
    with pgtask_engine.connect() as conn:
        # The child's fenced application transaction locks its attempt, not its task row: the
        # pass times the parent's wait out and asks the child to stop, without waiting.
        saved = d.save_checkpoint(conn, child, "invoice", {"id": 1}, kind="transaction")
        assert tuple(saved) == (True, True)
        assert d.wait_timeouts(auto) == [parent.task_id]
        assert d.task_of(auto, child.task_id)["cancel_requested_at"] is not None
        # The child's attempt still runs: its transaction commits with its checkpoint.
        conn.commit()
    assert d.checkpoints_of(auto, child.task_id) == {("invoice", 0): ("transaction", {"id": 1})}
    assert d.task_of(auto, parent.task_id)["state"] == "pending"


# -- parent terminal transition --------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A running parent with a child in every state, and a grandchild under the running one."""

    parent: Lease
    pending: uuid.UUID
    waiting: Lease
    running: Lease
    finished: uuid.UUID
    grandchild: uuid.UUID

    def descendants(self) -> list[uuid.UUID]:
        return [
            self.pending, self.waiting.task_id, self.running.task_id, self.finished,
            self.grandchild,
        ]


def family(conn: Connection) -> Family:
    parent = running(conn, "parent")
    ids = {
        name: d.spawn_child(conn, parent, name, name)
        for name in ("pending-child", "waiting-child", "running-child", "finished-child")
    }
    waiting = d.claim_one(conn, "waiting-child")
    d.waiting_on_signal(conn, waiting, "approval", "go", timeout=60.0)
    runner = d.claim_one(conn, "running-child")
    grandchild = d.spawn_child(conn, runner, "label", "grandchild")
    assert d.complete(conn, d.claim_one(conn, "finished-child"), "done")
    return Family(parent, ids["pending-child"], waiting, runner, ids["finished-child"], grandchild)


def _succeed(conn: Connection, tree: Family) -> None:
    assert d.complete(conn, tree.parent, "ok") == [(tree.parent.task_id, "succeeded")]


def _fail(conn: Connection, tree: Family) -> None:
    assert d.fail(conn, tree.parent, delay=None) == [(tree.parent.task_id, "failed")]


def _cancel_running(conn: Connection, tree: Family) -> None:
    # The cancel request was committed before; the attempt's outcome ends the task cancelled.
    assert d.complete(conn, tree.parent, "ok") == [(tree.parent.task_id, "cancelled")]


def _cancel_waiting(conn: Connection, tree: Family) -> None:
    assert d.cancel_task(conn, tree.parent.task_id) == "cancelled"


def _by_hand(conn: Connection, tree: Family) -> None:
    # An operator's own UPDATE, outside the library.
    conn.execute(
        text(
            "UPDATE pgtask.tasks SET state = 'failed', completed_at = now(), lease_token = NULL,"
            " lease_owner = NULL, lease_expires_at = NULL WHERE id = :id"
        ),
        {"id": tree.parent.task_id},
    )


def _arrange_cancel_running(conn: Connection, tree: Family) -> None:
    assert d.cancel_task(conn, tree.parent.task_id) == "running"


def _arrange_cancel_waiting(conn: Connection, tree: Family) -> None:
    d.waiting_on_signal(conn, tree.parent, "approval", "go")


#: How the parent becomes terminal: what is committed before, the transition, its final state.
TRANSITIONS: Final[dict[str, tuple[Callable[[Connection, Family], None] | None,
                                   Callable[[Connection, Family], None], str]]] = {
    "success": (None, _succeed, "succeeded"),
    "failure": (None, _fail, "failed"),
    "cancel-running": (_arrange_cancel_running, _cancel_running, "cancelled"),
    "cancel-waiting": (_arrange_cancel_waiting, _cancel_waiting, "cancelled"),
    "operator-update": (None, _by_hand, "failed"),
}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("transition", TRANSITIONS)
def test_parent_terminal_failure_before_commit_leaves_parent_and_children_unchanged(
    pgtask_engine: Engine, auto: Connection, killer: Connection, transition: str,
    failure: Failure,
) -> None:
    tree = family(auto)
    arrange, transit, _ = TRANSITIONS[transition]
    if arrange is not None:
        arrange(auto, tree)
    everyone = [tree.parent.task_id, *tree.descendants()]
    before = d.snapshot(auto, *everyone)
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        transit(conn, tree)
        assert d.snapshot(killer, *everyone) == before  # nothing visible yet
    assert d.snapshot(auto, *everyone) == before


@pytest.mark.parametrize("transition", TRANSITIONS)
def test_a_terminal_parent_cancels_its_unfinished_descendants(
    pgtask_engine: Engine, auto: Connection, killer: Connection, pgtask_clock: DatabaseClock,
    transition: str,
) -> None:
    tree = family(auto)
    arrange, transit, state = TRANSITIONS[transition]
    if arrange is not None:
        arrange(auto, tree)
    finished_before = d.snapshot(auto, tree.finished)
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        transit(conn, tree)
    # Failure after commit: the parent is terminal, its unfinished descendants cancelled.
    assert d.task_of(auto, tree.parent.task_id)["state"] == state
    assert d.wait_of(auto, tree.parent.task_id) is None
    reason = {"type": "cancelled", "reason": "ancestor_finished",
              "ancestor_id": str(tree.parent.task_id)}
    for task_id in (tree.pending, tree.waiting.task_id, tree.grandchild):
        task = d.task_of(auto, task_id)
        assert (task["state"], task["error"]) == ("cancelled", reason), task_id
        assert task["completed_at"] is not None
        assert task["cancel_requested_at"] is not None
    assert d.wait_of(auto, tree.waiting.task_id) is None
    runner = d.task_of(auto, tree.running.task_id)
    assert (runner["state"], runner["lease_token"]) == ("running", tree.running.token)
    assert runner["cancel_requested_at"] is not None
    assert d.snapshot(auto, tree.finished) == finished_before
    # Recovery: no action. The running child's renewal reports the request and its outcome
    # is recorded as cancelled; the cancelled waiting child's timeout and signal change nothing.
    renewed = auto.execute(st.RENEW, st.renew_params([tree.running], d.LEASE)).all()
    assert [tuple(row) for row in renewed] == [(tree.running.task_id, True)]
    assert d.complete(auto, tree.running, "late") == [(tree.running.task_id, "cancelled")]
    pgtask_clock.advance(61)
    assert d.wait_timeouts(auto) == []
    d.emit(auto, tree.waiting.task_id, "go", "late")
    assert d.task_of(auto, tree.waiting.task_id)["state"] == "cancelled"
    assert d.checkpoints_of(auto, tree.waiting.task_id) == {}


@pytest.mark.parametrize("suspension", ["retry", "sleep", "signal-wait"])
def test_a_parent_that_is_not_terminal_leaves_its_children_alone(
    auto: Connection, suspension: str
) -> None:
    tree = family(auto)
    before = d.snapshot(auto, *tree.descendants())
    if suspension == "retry":
        assert d.fail(auto, tree.parent, delay=0.0) == [(tree.parent.task_id, "pending")]
    elif suspension == "sleep":
        assert d.sleep(auto, tree.parent, "nap", delay=60.0).suspended
    else:
        d.waiting_on_signal(auto, tree.parent, "approval", "go")
    assert d.snapshot(auto, *tree.descendants()) == before


def test_cancelling_a_waiting_parent_while_its_child_completes_does_not_deadlock(
    pgtask_engine: Engine, auto: Connection, killer: Connection
) -> None:
    # Grandparent G spawns P; P spawns C and waits for it; C runs. G is registering a wait
    # for P (its LOCK_CHILD holds P's row for a moment): the operator's cancel(P) queues
    # behind it. C's completion must wake P, but never waits for P's row (the cancel, once it
    # has P, waits for C: waiting here would deadlock); it fails at once (55P03) and is
    # written again, as the worker's completer does.
    grandparent = running(auto, "grandparent")
    parent_id = d.spawn_child(auto, grandparent, "spawn", "parent")
    parent = d.claim_one(auto, "parent")
    child_id = d.spawn_child(auto, parent, "spawn", "child")
    d.waiting_on_child(auto, parent, "await-child", child_id)
    child = d.claim_one(auto, "child")
    with pgtask_engine.connect() as registering:
        d.waiting_on_child(registering, grandparent, "await-parent", parent_id)
        cancelling = d.Blocked(pgtask_engine, killer, lambda c: d.cancel_task(c, parent_id))
        with pgtask_engine.connect() as completing, pytest.raises(OperationalError) as held:
            d.complete(completing, child, "done")
        assert getattr(held.value.orig, "sqlstate", None) == d.LOCK_NOT_AVAILABLE
        registering.commit()
    assert cancelling.result() == "cancelled"
    # The cancel asked the running child to stop; the completion written now records that.
    assert d.complete_until_written(auto, child, "done") == ("cancelled", 0)
    assert d.task_of(auto, parent_id)["state"] == "cancelled"
    assert d.task_of(auto, child_id)["state"] == "cancelled"


# -- emit signal -----------------------------------------------------------------------------


def waiting_for_signal(conn: Connection) -> Lease:
    lease = running(conn)
    d.waiting_on_signal(conn, lease, "approval", "go")
    return lease


@pytest.mark.parametrize("failure", FAILURES)
def test_emit_failure_before_commit_leaves_the_signal_absent_and_the_waiter_waiting(
    pgtask_engine: Engine, auto: Connection, killer: Connection, failure: Failure
) -> None:
    lease = waiting_for_signal(auto)
    before = d.snapshot(auto, lease.task_id)
    with d.killed_before_commit(pgtask_engine, killer, failure) as conn:
        assert d.emit(conn, lease.task_id, "go", {"v": 1}) == {"v": 1}
        # The wake-up belongs to the emitter's transaction.
        assert d.snapshot(killer, lease.task_id) == before
    # Failure before commit: the signal remains absent; the waiter still waits.
    assert d.snapshot(auto, lease.task_id) == before
    # Recovery: the emitter retries (its value may differ: nothing was stored).
    assert d.emit(auto, lease.task_id, "go", {"v": 2}) == {"v": 2}
    assert d.task_of(auto, lease.task_id)["state"] == "pending"
    assert d.checkpoints_of(auto, lease.task_id) == {
        ("approval", 0): ("signal", {"signal": {"v": 2}})
    }


def test_emit_after_commit_is_durable_immutable_and_wakes_the_waiter(
    pgtask_engine: Engine, auto: Connection, killer: Connection
) -> None:
    lease = waiting_for_signal(auto)
    with d.killed_after_commit(pgtask_engine, killer) as conn:
        assert d.emit(conn, lease.task_id, "go", {"v": 1}) == {"v": 1}
    # Failure after commit: the signal is durable and the waiter woke with it.
    stored = auto.execute(
        text("SELECT value, created_at FROM pgtask.signals WHERE task_id = :id"),
        {"id": lease.task_id},
    ).one()
    assert stored.value == {"v": 1}
    assert d.task_of(auto, lease.task_id)["state"] == "pending"
    checkpoint = {("approval", 0): ("signal", {"signal": {"v": 1}})}
    assert d.checkpoints_of(auto, lease.task_id) == checkpoint
    # Recovery: the emitter, not knowing the outcome, retries: the stored value comes back
    # and nothing changes (immutable).
    assert d.emit(auto, lease.task_id, "go", {"v": 2}) == {"v": 1}
    again = auto.execute(
        text("SELECT value, created_at FROM pgtask.signals WHERE task_id = :id"),
        {"id": lease.task_id},
    ).one()
    assert tuple(again) == tuple(stored)
    assert d.checkpoints_of(auto, lease.task_id) == checkpoint
    # The waiter replays it.
    assert d.claim_one(auto).attempt == 2
    assert d.replay(auto, lease.task_id) == checkpoint


def test_a_signal_emitted_before_the_wait_is_kept_until_the_task_asks(auto: Connection) -> None:
    lease = running(auto)
    before = d.task_of(auto, lease.task_id)
    assert d.emit(auto, lease.task_id, "go", "early") == "early"
    assert d.task_of(auto, lease.task_id) == before  # only stored
    row = d.register_signal_wait(auto, lease, "approval", "go")
    assert row is not None
    assert (row.held, row.value, row.waiting) == (True, {"signal": "early"}, False)
    assert_holds(auto, lease)


@pytest.mark.parametrize("first_emitter", ["commits", "rolls back"])
def test_concurrent_emitters_of_one_signal_keep_the_first_committed_value(
    pgtask_engine: Engine, auto: Connection, killer: Connection, first_emitter: str
) -> None:
    lease = waiting_for_signal(auto)
    with pgtask_engine.connect() as first:
        assert d.emit(first, lease.task_id, "go", "a") == "a"
        second = d.Blocked(pgtask_engine, killer, lambda c: d.emit(c, lease.task_id, "go", "b"))
        if first_emitter == "commits":
            first.commit()
            winner = "a"
        else:
            first.rollback()
            winner = "b"
    assert second.result() == winner
    assert d.signals_of(auto, lease.task_id) == {("go", 0): winner}
    assert d.task_of(auto, lease.task_id)["state"] == "pending"
    assert d.checkpoints_of(auto, lease.task_id) == {
        ("approval", 0): ("signal", {"signal": winner})
    }


# -- suspension and cancellation -------------------------------------------------------------


def test_suspensions_never_count_as_failed_attempts(
    auto: Connection, pgtask_clock: DatabaseClock
) -> None:
    # One attempt allowed: only a failure would use it up.
    first = running(auto, max_attempts=1)
    task_id = first.task_id
    assert d.sleep(auto, first, "nap", delay=10.0).suspended
    assert_suspended(auto, first, "pending")
    pgtask_clock.advance(11)
    second = d.claim_one(auto)
    d.waiting_on_signal(auto, second, "approval", "go")
    assert_suspended(auto, second, "waiting")
    d.emit(auto, task_id, "go", True)
    third = d.claim_one(auto)
    child = d.spawn_child(auto, third, "ship")
    d.waiting_on_child(auto, third, "await-ship", child)
    assert_suspended(auto, third, "waiting")
    assert d.complete(auto, d.claim_one(auto, "child"), "shipped")
    fourth = d.claim_one(auto)
    assert fourth.attempt == 4
    assert d.complete(auto, fourth, "done") == [(task_id, "succeeded")]
    task = d.task_of(auto, task_id)
    assert (task["attempt"], task["failed_attempts"], task["max_attempts"]) == (4, 0, 1)
    assert [a["state"] for a in read_attempts(auto, task_id)] == [
        "suspended", "suspended", "suspended", "succeeded",
    ]


@pytest.mark.parametrize("wait", ["signal", "child"])
def test_cancelling_a_waiting_task_deletes_its_wait(
    auto: Connection, pgtask_clock: DatabaseClock, wait: str
) -> None:
    lease = running(auto, "parent")
    child = d.spawn_child(auto, lease, "ship")
    child_lease = d.claim_one(auto, "child")
    if wait == "signal":
        d.waiting_on_signal(auto, lease, "approval", "go", timeout=60.0)
    else:
        d.waiting_on_child(auto, lease, "await-ship", child, timeout=60.0)
    assert d.cancel_task(auto, lease.task_id) == "cancelled"
    assert d.wait_of(auto, lease.task_id) is None
    before = d.task_of(auto, lease.task_id)
    expected = {("ship", 0): ("spawn", {"task_id": str(child)})}
    # A later timeout pass finds nothing.
    pgtask_clock.advance(61)
    assert d.wait_timeouts(auto) == []
    # A later signal is only stored; the child's end wakes nobody.
    assert d.emit(auto, lease.task_id, "go", "late") == "late"
    assert d.complete(auto, child_lease, "late") == [(child, "cancelled")]  # by the cascade
    assert d.task_of(auto, lease.task_id) == before
    assert d.checkpoints_of(auto, lease.task_id) == expected


# -- review findings ---------------------------------------------------------------------------


def test_a_spawn_writes_nothing_once_cancellation_was_requested(auto: Connection) -> None:
    # A running task whose cancellation was requested (by an operator, a cascade or a
    # result-wait timeout) must not start new work: its spawn matches no fence.
    lease = running(auto)
    assert d.cancel_task(auto, lease.task_id) == "running"
    row = d.spawn(auto, lease, "ship", "child")
    assert (row.held, row.child_id) == (False, None)
    assert d.checkpoints_of(auto, lease.task_id) == {}
    assert auto.execute(text("SELECT count(*) FROM pgtask.tasks")).scalar_one() == 1


def test_cancelling_a_waiting_parent_writes_no_result_checkpoint_for_its_cascaded_child(
    auto: Connection,
) -> None:
    # The cascade cancels the child before the parent's wait row goes (triggers fire by
    # name): the child's end must not record a result for a parent that is no longer waiting.
    parent = running(auto, "parent")
    child = d.spawn_child(auto, parent, "ship")
    d.waiting_on_child(auto, parent, "await-ship", child)
    assert d.cancel_task(auto, parent.task_id) == "cancelled"
    assert d.task_of(auto, child)["state"] == "cancelled"
    assert d.checkpoints_of(auto, parent.task_id) == {
        ("ship", 0): ("spawn", {"task_id": str(child)})
    }
    assert d.wait_of(auto, parent.task_id) is None


def test_a_checkpoint_write_never_holds_up_a_lease_renewal(
    pgtask_engine: Engine, auto: Connection
) -> None:
    # The checkpoint fence locks the attempt's row, not the task's: a renewal (which updates
    # the task row) neither waits for nor skips a task whose checkpoint is being written.
    lease = running(auto)
    with pgtask_engine.connect() as saving:
        assert d.save_checkpoint(saving, lease, "charge", {"ok": True}).held
        renewed = auto.execute(st.RENEW, st.renew_params([lease], 30.0)).all()
        assert [row.id for row in renewed] == [lease.task_id]
        saving.commit()
    assert d.checkpoints_of(auto, lease.task_id) == {("charge", 0): ("step", {"ok": True})}


def test_a_checkpoint_in_a_repeatable_read_transaction_survives_renewals_during_it(
    pgtask_engine: Engine, auto: Connection
) -> None:
    # ctx.transaction runs in the engine's isolation: at REPEATABLE READ the fence must not
    # fail because a renewal changed the task row after the transaction's snapshot.
    lease = running(auto)
    with pgtask_engine.execution_options(isolation_level="REPEATABLE READ").connect() as app:
        app.execute(text("SELECT 1"))  # the snapshot is taken
        assert auto.execute(st.RENEW, st.renew_params([lease], 30.0)).all()
        row = d.save_checkpoint(app, lease, "insert", {"result": 1}, kind="transaction")
        assert (row.held, row.saved) == (True, True)
        app.commit()


async def test_the_timeout_pass_does_not_spin_on_a_due_wait_another_transaction_holds(
    pgtask_engine: Engine, pgtask_async_engine: AsyncEngine, auto: Connection
) -> None:
    lease = waiting_for_signal(auto)
    d.make_wait_due(auto, lease.task_id)
    service = WaitTimeouts(interval=5.0, batch_size=10)
    with pgtask_engine.connect() as holder:
        holder.execute(  # an application holds the waiting task's row (a long transaction)
            text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE"), {"id": lease.task_id}
        )
        async with pgtask_async_engine.connect() as conn:
            again = await service.run_once(conn)
            await conn.commit()
        assert again is not None
        assert again >= 0.5  # due, but held: look again in a moment, not at once
        holder.rollback()
    async with pgtask_async_engine.connect() as conn:
        assert await service.run_once(conn) is None  # taken now; no wait left
        await conn.commit()
    assert d.task_of(auto, lease.task_id)["state"] == "pending"


def test_a_child_timeout_cancels_the_subtree_of_a_running_child_at_once(
    auto: Connection, pgtask_clock: DatabaseClock
) -> None:
    # The timed-out child is running: it only gets a cancel request (its worker stops it),
    # but its own children are cancelled now, not when it ends.
    parent = running(auto, "parent")
    child_id = d.spawn_child(auto, parent, "ship")
    d.waiting_on_child(auto, parent, "await-ship", child_id, timeout=60.0)
    child = d.claim_one(auto, "child")
    grandchild = d.spawn_child(auto, child, "label", "grandchild")
    pgtask_clock.advance(61)
    assert d.wait_timeouts(auto) == [parent.task_id]
    row = d.task_of(auto, child_id)
    assert (row["state"], row["cancel_requested_at"] is not None) == ("running", True)
    below = d.task_of(auto, grandchild)
    assert below["state"] == "cancelled"
    assert below["error"] == {
        "type": "cancelled", "reason": "result_wait_timeout", "waiter_id": str(parent.task_id),
    }
