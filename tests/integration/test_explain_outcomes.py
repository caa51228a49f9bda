"""`explain` tells what will really happen to a task, checked against the statement that does it.

Each situation is built with the worker's own statements, explained in a read-only snapshot,
and then the transition the explanation announces is run for real (lease recovery, the wait
timeout pass): the task must end where the explanation said it would.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import Explanation, Reason, cancel, explain, retry
from tests.support import durable


@pytest.fixture
def conn(pgtask_engine: Engine) -> Iterator[Connection]:
    """An autocommit connection: each statement of the setting-up commits at once."""
    with pgtask_engine.connect() as connection:
        yield connection.execution_options(isolation_level="AUTOCOMMIT")


def explained(engine: Engine, task_id: object) -> Explanation:
    with Session(engine) as session:
        session.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        return explain(session, str(task_id))


def only(explanation: Explanation) -> Reason:
    [reason] = explanation.reasons
    return reason


def test_an_expired_lease_on_the_last_attempt_says_recovery_fails_the_task(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    durable.claim_one(conn, max_attempts=1)
    durable.expire_lease(conn, task_id)

    reason = only(explained(pgtask_engine, task_id))

    assert reason.code == "running"
    assert "pending again" not in reason.message
    assert "lease recovery will fail the task" in reason.message
    assert "no attempt left of 1 allowed" in reason.message
    assert durable.recover(conn) == [(task_id, "failed")]


def test_an_expired_lease_with_attempts_left_says_recovery_makes_it_pending(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    durable.claim_one(conn, max_attempts=2)
    durable.expire_lease(conn, task_id)

    reason = only(explained(pgtask_engine, task_id))

    assert "lease recovery will make the task pending again" in reason.message
    assert durable.recover(conn) == [(task_id, "pending")]


def test_an_expired_lease_with_a_cancel_request_says_recovery_cancels_the_task(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    durable.claim_one(conn, max_attempts=5)
    assert cancel(conn, task_id) == "running"  # a request the (dead) worker never acts on
    durable.expire_lease(conn, task_id)

    reason = only(explained(pgtask_engine, task_id))

    assert reason.code == "running"
    assert "pending again" not in reason.message
    assert "the worker stops it" not in reason.message
    assert "lease recovery will cancel the task" in reason.message
    assert durable.recover(conn) == [(task_id, "cancelled")]


def test_a_child_cancelled_by_its_parents_wait_timeout_names_the_waiter(
    pgtask_engine: Engine, conn: Connection
) -> None:
    parent = durable.add_task(conn, "parent")
    lease = durable.claim_one(conn, "parent")
    child = durable.spawn_child(conn, lease, "spawn", "child")
    durable.waiting_on_child(conn, lease, "await-child", child, timeout=60.0)
    durable.make_wait_due(conn, parent)
    assert durable.wait_timeouts(conn) == [parent]

    reason = only(explained(pgtask_engine, child))

    assert reason.code == "terminal"
    assert reason.error is not None
    assert reason.error["reason"] == "result_wait_timeout"
    assert f"because task {parent} gave up waiting for it" in reason.message
    assert reason.actor is None  # no audit entry: nobody cancelled it by hand


def test_a_cancellation_is_not_blamed_on_an_audit_entry_older_than_a_retry(
    pgtask_engine: Engine, conn: Connection
) -> None:
    """Bob cancelled the child, an operator retried it, then its parent's end cancelled it:
    bob's entry is about an earlier life of the task and must not be named as the cause."""
    durable.add_task(conn, "parent")
    lease = durable.claim_one(conn, "parent")
    child = durable.spawn_child(conn, lease, "spawn", "child")
    assert cancel(conn, child, actor="bob", reason="duplicate order") == "cancelled"
    assert retry(conn, child, actor="ann") == "cancelled"  # the state it left
    child_lease = durable.claim_one(conn, "child")
    durable.complete(conn, lease)  # the parent ends: its running child gets a cancel request
    assert durable.complete(conn, child_lease)[0][1] == "cancelled"

    reason = only(explained(pgtask_engine, child))

    assert reason.code == "terminal"
    assert "bob" not in reason.message
    assert "duplicate order" not in reason.message
    assert (reason.actor, reason.audit_reason) == (None, None)
