"""`explain`: why a task is not running now, one test per reason, each situation built for real.

Workers are registered with the worker's own registration statements (or, for the handler
versions, by a real `Worker`); claims, sleeps, waits and spawns run the statements the worker
runs (``tests.support.durable``); queues are paused and rate-limited through the public API.
Every explanation is read in a read-only transaction: an `explain` that wrote, or locked a
row (``SELECT ... FOR UPDATE`` is refused in a read-only transaction), would fail here.
"""

from __future__ import annotations

import inspect
import sys
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta

import pytest
from sqlalchemy import Connection, Engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    Explanation,
    Reason,
    Registry,
    TaskContext,
    TaskNotFound,
    ValidationError,
    WorkerOptions,
    cancel,
    configure_queue,
    enqueue,
    explain,
    explain_async,
    pause_queue,
    statements,
)
from sqlalchemy_pgtask.explain import REASON_CODES, WorkerSlots
from sqlalchemy_pgtask.grants import grant_roles
from sqlalchemy_pgtask.models import Queue, RateBucket, Task
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker
from tests.support import durable
from tests.support.roles import acting_as, temporary_role
from tests.support.tasks import claim_parameters

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
HOUR = 3600.0


@pytest.fixture
def conn(pgtask_engine: Engine) -> Iterator[Connection]:
    """An autocommit connection: each statement of the setting-up commits at once."""
    with pgtask_engine.connect() as connection:
        yield connection.execution_options(isolation_level="AUTOCOMMIT")


def explained(engine: Engine, task_id: uuid.UUID | str) -> Explanation:
    with Session(engine) as session:
        session.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        return explain(session, task_id)


def only(explanation: Explanation) -> Reason:
    [reason] = explanation.reasons
    return reason


def register_worker(
    conn: Connection,
    *,
    identities: Sequence[tuple[str, int]] = (("job", durable.VERSION),),
    queue: str = "default",
    concurrency: int = 10,
    draining: bool = False,
) -> uuid.UUID:
    """Register a live worker with the worker's own statements; its id."""
    worker_id = uuid.uuid4()
    conn.execute(statements.REGISTER_WORKER, {
        "worker_id": worker_id, "queues": [queue], "version": "test", "hostname": "host-a",
        "pid": 4242, "concurrency": concurrency, "ttl_seconds": HOUR, "lock_key": None,
    })
    conn.execute(statements.ADD_CAPABILITIES, {
        "worker_id": worker_id, "queues": [queue] * len(identities),
        "names": [name for name, _ in identities],
        "versions": [version for _, version in identities],
    })
    if draining:
        conn.execute(
            statements.HEARTBEAT,
            {"worker_id": worker_id, "ttl_seconds": HOUR, "draining": True},
        )
    return worker_id


def run_at(conn: Connection, task_id: uuid.UUID) -> object:
    return conn.execute(select(Task.run_at).where(Task.id == task_id)).scalar_one()


# -- unknown tasks ---------------------------------------------------------------------------


def test_an_unknown_task_raises_task_not_found(pgtask_engine: Engine) -> None:
    missing = uuid.uuid4()
    with pytest.raises(TaskNotFound, match=str(missing)):
        explained(pgtask_engine, missing)


def test_a_task_id_that_is_no_uuid_is_refused_before_any_sql(pgtask_engine: Engine) -> None:
    with pytest.raises(ValidationError, match="task_id"):
        explained(pgtask_engine, "not-a-uuid")


def test_explain_leaves_the_sessions_pending_objects_unflushed(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    with Session(pgtask_engine) as session:
        queue = Queue(name="not-flushed")
        session.add(queue)
        assert explain(session, task_id).codes == ("no_live_worker",)
        assert queue in session.new
        session.rollback()
    assert conn.execute(select(Queue.name).where(Queue.name == "not-flushed")).first() is None


# -- pending ---------------------------------------------------------------------------------


def test_a_delayed_task_is_not_due_until_its_run_at(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn)
    task_id = durable.add_task(conn, delay=HOUR)

    explanation = explained(pgtask_engine, task_id)

    assert (explanation.state, explanation.codes) == ("pending", ("not_due",))
    reason = only(explanation)
    assert reason.until is not None
    assert reason.until == run_at(conn, task_id)
    assert reason.until - explanation.now > timedelta(minutes=59)
    assert "not due until" in reason.message
    assert "(in 59m" in reason.message


def test_a_retry_waiting_out_its_backoff_is_not_due_and_says_why(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn)
    task_id = durable.add_task(conn)
    durable.fail(conn, durable.claim_one(conn), delay=HOUR)

    reason = only(explained(pgtask_engine, task_id))

    assert reason.code == "not_due"
    assert "retry after failed attempt 1" in reason.message
    assert "handler_error: ValueError: boom" in reason.message


def test_a_task_in_a_durable_sleep_is_sleeping_until_its_wake_time(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn)
    task_id = durable.add_task(conn)
    slept = durable.sleep(conn, durable.claim_one(conn), "nap", delay=HOUR)
    assert slept.suspended

    explanation = explained(pgtask_engine, task_id)

    assert (explanation.state, explanation.codes) == ("pending", ("sleeping",))
    reason = only(explanation)
    assert (reason.step, reason.until) == ("nap", slept.wake_at)
    assert "durable sleep at step 'nap'" in reason.message


def test_a_sleep_whose_wake_time_passed_is_ready_not_sleeping(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock, conn: Connection
) -> None:
    register_worker(conn)
    task_id = durable.add_task(conn)
    durable.sleep(conn, durable.claim_one(conn), "nap", delay=60)
    pgtask_clock.advance(61)

    assert explained(pgtask_engine, task_id).codes == ("ready",)


def test_a_task_of_a_paused_queue_says_who_paused_it_and_why(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn)
    task_id = durable.add_task(conn)
    settings = pause_queue(conn, "default", actor="ann", reason="database upgrade")

    explanation = explained(pgtask_engine, task_id)

    assert explanation.codes == ("queue_paused",)
    reason = only(explanation)
    assert (reason.since, reason.actor, reason.audit_reason) == (
        settings.paused_at, "ann", "database upgrade",
    )
    assert "queue 'default' is paused" in reason.message
    assert "by ann (database upgrade)" in reason.message
    assert "pgtask queue resume default" in reason.message


def test_several_reasons_hold_at_once(pgtask_engine: Engine, conn: Connection) -> None:
    task_id = durable.add_task(conn, delay=HOUR)
    pause_queue(conn, "default")

    explanation = explained(pgtask_engine, task_id)

    assert explanation.codes == ("not_due", "queue_paused", "no_live_worker")
    lines = str(explanation).splitlines()
    assert lines[0] == f"task {task_id} (job v1, queue default): pending"
    assert [line[:2] for line in lines[1:]] == ["- "] * 3


def test_with_no_worker_live_no_live_worker_says_so(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)

    reason = only(explained(pgtask_engine, task_id))

    assert (reason.code, reason.live_versions) == ("no_live_worker", ())
    assert reason.message == (
        "no worker is live; start one with handler 'job' version 1 for queue 'default'"
    )


async def test_no_live_worker_names_the_handler_versions_live_workers_have(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_async_engine: AsyncEngine
) -> None:
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "job", None, version=1).id
    registry = Registry()

    for version in (2, 3):
        @registry.task("job", version=version)
        async def job(ctx: TaskContext, payload: None) -> None:
            return None

    async with (
        running_worker(registry, pgtask_database_url, OPTIONS),
        AsyncSession(pgtask_async_engine) as session,
    ):
        explanation = await explain_async(session, task_id)

    reason = only(explanation)
    assert (reason.code, reason.live_versions) == ("no_live_worker", (2, 3))
    assert reason.message == (
        "no live worker has handler 'job' version 1 for queue 'default'; live workers have "
        "version(s) 2, 3 of it"
    )


def test_no_live_worker_when_the_live_workers_serve_other_queues_or_drain(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn, queue="emails")
    task_id = durable.add_task(conn)
    assert "no live worker serves queue 'default'" in only(
        explained(pgtask_engine, task_id)
    ).message

    register_worker(conn, draining=True)
    reason = only(explained(pgtask_engine, task_id))
    assert reason.code == "no_live_worker"
    assert reason.message.startswith("only draining workers have handler 'job' version 1")


def test_a_spent_rate_limit_holds_a_due_task_until_the_bucket_refills(
    pgtask_engine: Engine, conn: Connection
) -> None:
    worker_id = register_worker(conn)
    configure_queue(conn, "default", rate_limit=1, rate_period=HOUR)
    first, second = (durable.add_task(conn) for _ in range(2))
    claim = claim_parameters(worker_id=worker_id, lease=HOUR, limit=10)
    # The first governed claim creates the bucket (full); the second spends its one token.
    assert conn.execute(statements.CLAIM_GOVERNED, claim).all() == []
    [claimed] = conn.execute(statements.CLAIM_GOVERNED, claim).all()
    waiting = second if claimed.id == first else first
    refilled_at = conn.execute(select(RateBucket.refilled_at)).scalar_one()

    explanation = explained(pgtask_engine, waiting)

    reason = only(explanation)
    assert reason.code == "rate_limited"
    assert reason.until is not None
    # One token back after a whole period: the bucket was emptied at refilled_at.
    assert abs((reason.until - refilled_at).total_seconds() - HOUR) < 1.0
    assert "rate limited to 1 per 3600s and has no start left until" in reason.message


def test_an_observer_who_cannot_read_rate_buckets_is_told_so_and_the_rest_still_reads(
    pgtask_engine: Engine, conn: Connection
) -> None:
    """The observer level reads no rate bucket (docs/roles.md): explain leaves that detail out
    instead of failing, and the caller's transaction stays usable."""
    register_worker(conn)
    configure_queue(conn, "default", rate_limit=5, rate_period=60)
    task_id = durable.add_task(conn)
    with pgtask_engine.connect() as owner:
        role = temporary_role(owner, "observer")
        grant_roles(owner, observer=role)
        with acting_as(owner, role):
            explanation = explain(owner, task_id)
            assert owner.execute(select(Task.state).where(Task.id == task_id)).scalar_one() == (
                "pending"
            )
        owner.rollback()

    reason = only(explanation)
    assert (reason.code, reason.until) == ("rate_limited", None)
    assert "cannot read pgtask.rate_buckets" in reason.message


def test_when_every_able_worker_is_busy_workers_busy_lists_their_slots(
    pgtask_engine: Engine, conn: Connection
) -> None:
    worker_id = register_worker(conn, concurrency=1)
    first = durable.add_task(conn)
    durable.claim_one(conn, worker_id=worker_id)
    second = durable.add_task(conn)
    assert first != second

    reason = only(explained(pgtask_engine, second))

    assert reason.code == "workers_busy"
    assert reason.workers == (WorkerSlots(worker_id, 1, 1),)
    assert f"{worker_id} runs 1 of 1" in reason.message


def test_a_due_task_nothing_holds_back_is_ready(pgtask_engine: Engine, conn: Connection) -> None:
    worker_id = register_worker(conn, concurrency=2)
    durable.add_task(conn)
    durable.claim_one(conn, worker_id=worker_id)  # one slot of two taken: still room
    task_id = durable.add_task(conn)

    explanation = explained(pgtask_engine, task_id)

    assert explanation.codes == ("ready",)
    assert "nothing holds it back: 1 live worker(s) can run it" in only(explanation).message


def test_a_task_of_a_queue_at_capacity_says_so_and_that_it_is_admitted(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn, concurrency=10)
    configure_queue(conn, "default", max_outstanding_tasks=2)
    first = durable.add_task(conn)
    durable.add_task(conn)

    explanation = explained(pgtask_engine, first)

    # Full, the queue refuses new work; the admitted task is still ready to be claimed.
    assert explanation.codes == ("queue_at_capacity", "ready")
    reason = explanation.reasons[0]
    assert "at its capacity (2 of 2 outstanding tasks)" in reason.message
    assert "PT001" in reason.message


def test_a_queue_below_its_capacity_says_nothing_of_it(
    pgtask_engine: Engine, conn: Connection
) -> None:
    register_worker(conn, concurrency=10)
    configure_queue(conn, "default", max_outstanding_tasks=3)
    task_id = durable.add_task(conn)

    assert explained(pgtask_engine, task_id).codes == ("ready",)


# -- waiting and running ---------------------------------------------------------------------


def test_a_task_waiting_for_a_signal_names_it_and_its_timeout(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    durable.waiting_on_signal(
        conn, durable.claim_one(conn), "await-approval", "approval", signal_occurrence=2,
        timeout=HOUR,
    )

    explanation = explained(pgtask_engine, task_id)

    assert (explanation.state, explanation.codes) == ("waiting", ("waiting_signal",))
    reason = only(explanation)
    assert (reason.signal_name, reason.signal_occurrence, reason.step) == (
        "approval", 2, "await-approval",
    )
    assert reason.since is not None
    assert reason.until is not None
    assert reason.until - reason.since == timedelta(hours=1)
    assert "waiting for signal 'approval' (occurrence 2)" in reason.message


def test_a_task_waiting_for_its_child_names_the_child_and_its_state(
    pgtask_engine: Engine, conn: Connection
) -> None:
    parent = durable.add_task(conn, "parent")
    lease = durable.claim_one(conn, "parent")
    child = durable.spawn_child(conn, lease, "spawn", "child")
    durable.waiting_on_child(conn, lease, "await-child", child)

    reason = only(explained(pgtask_engine, parent))

    assert (reason.code, reason.child_id, reason.child_state, reason.until) == (
        "waiting_child", child, "pending", None,
    )
    assert f"waiting for child task {child} (child, pending) to finish" in reason.message
    assert "with no timeout" in reason.message


def test_a_waiting_task_without_a_recorded_wait_says_so(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    conn.execute(text("UPDATE pgtask.tasks SET state = 'waiting' WHERE id = :id"), {"id": task_id})

    assert only(explained(pgtask_engine, task_id)).code == "waiting"


def test_a_running_task_names_its_worker_and_lease(pgtask_engine: Engine, conn: Connection) -> None:
    worker_id = register_worker(conn)
    task_id = durable.add_task(conn)
    durable.claim_one(conn, worker_id=worker_id)
    expires = conn.execute(select(Task.lease_expires_at).where(Task.id == task_id)).scalar_one()

    explanation = explained(pgtask_engine, task_id)

    assert (explanation.state, explanation.codes) == ("running", ("running",))
    reason = only(explanation)
    assert (reason.worker_id, reason.until) == (worker_id, expires)
    assert f"running on worker {worker_id} (host-a, pid 4242)" in reason.message
    assert "its lease runs until" in reason.message


def test_a_running_task_whose_lease_expired_says_recovery_will_take_it_back(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    durable.claim_one(conn)  # by a worker that never registered
    durable.expire_lease(conn, task_id)

    reason = only(explained(pgtask_engine, task_id))

    assert reason.code == "running"
    assert "lease expired at" in reason.message
    assert "no live registration" in reason.message


# -- terminal --------------------------------------------------------------------------------


def test_a_succeeded_task_is_terminal(pgtask_engine: Engine, conn: Connection) -> None:
    task_id = durable.add_task(conn)
    durable.complete(conn, durable.claim_one(conn), {"ok": True})

    explanation = explained(pgtask_engine, task_id)

    assert (explanation.state, explanation.codes) == ("succeeded", ("terminal",))
    assert only(explanation).message.startswith("it succeeded at ")


def test_a_failed_task_is_terminal_with_its_error(pgtask_engine: Engine, conn: Connection) -> None:
    task_id = durable.add_task(conn)
    durable.fail(conn, durable.claim_one(conn, max_attempts=1), delay=None)

    explanation = explained(pgtask_engine, task_id)

    assert (explanation.state, explanation.codes) == ("failed", ("terminal",))
    reason = only(explanation)
    assert reason.error is not None
    assert reason.error["type"] == "handler_error"
    assert "after 1 failed attempt(s) of 1 allowed: handler_error: ValueError: boom" in (
        reason.message
    )
    assert f"pgtask task retry {task_id}" in reason.message


def test_a_cancelled_task_is_terminal_and_says_who_cancelled_it(
    pgtask_engine: Engine, conn: Connection
) -> None:
    task_id = durable.add_task(conn)
    cancel(conn, task_id, actor="bob", reason="duplicate order")

    reason = only(explained(pgtask_engine, task_id))

    assert (reason.code, reason.actor, reason.audit_reason) == (
        "terminal", "bob", "duplicate order",
    )
    assert "cancelled at" in reason.message
    assert "by bob (duplicate order)" in reason.message


def test_a_child_cancelled_with_its_parent_names_the_ancestor(
    pgtask_engine: Engine, conn: Connection
) -> None:
    parent = durable.add_task(conn, "parent")
    lease = durable.claim_one(conn, "parent")
    child = durable.spawn_child(conn, lease, "spawn", "child")
    durable.complete(conn, lease)

    reason = only(explained(pgtask_engine, child))

    assert reason.code == "terminal"
    assert f"because its ancestor {parent} finished first" in reason.message


def test_a_task_behind_its_full_concurrency_key_names_the_holder_and_the_limit(
    pgtask_engine: Engine, conn: Connection
) -> None:
    holder = durable.add_task(conn, concurrency_key="customer-42")
    waiter = durable.add_task(conn, concurrency_key="customer-42")
    lease = durable.claim_one(conn)
    assert lease.task_id == holder

    codes = explained(pgtask_engine, waiter).codes
    reason = explained(pgtask_engine, waiter).reasons[-1]

    assert "ready" not in codes
    assert reason.code == "concurrency_key"
    assert reason.message == (
        f"waiting for concurrency key 'customer-42' (held by task {holder}, limit 1)"
    )
    durable.complete(conn, lease)
    assert "concurrency_key" not in explained(pgtask_engine, waiter).codes


def test_every_reason_code_is_asserted_by_a_test_here() -> None:
    """A code added to `REASON_CODES` without a test of its own fails this."""
    source = inspect.getsource(sys.modules[__name__])
    own = inspect.getsource(test_every_reason_code_is_asserted_by_a_test_here)
    rest = source.replace(own, "")
    assert [code for code in REASON_CODES if f'"{code}"' not in rest] == []
