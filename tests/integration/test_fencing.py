"""Statement-level proofs of the transition matrix: claim, renew, complete, fail, release, recover.

Each test runs the compiled statements of ``sqlalchemy_pgtask.statements`` directly, with the
parameters their builders make (the worker binds nothing else), over several connections to a
real PostgreSQL. A lease is expired by
moving ``lease_expires_at`` into the past with database time, never by sleeping.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, cast

import pytest
from sqlalchemy import Connection, Engine, insert, select, text, update

from sqlalchemy_pgtask import Queue, RetryPolicy, Task, cancel, enqueue
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.outcome import error_document
from tests.support.tasks import claim_parameters, read_attempts, read_task

LEASE = 30.0
WORKER = uuid.UUID("00000000-0000-4000-8000-000000000001")
Lease = st.Lease


# -- the worker's parameters ---------------------------------------------------------------


def claim(
    conn: Connection, *, worker_id: uuid.UUID = WORKER, lease: float = LEASE, **kwargs: Any
) -> Sequence[Any]:
    parameters = claim_parameters(worker_id=worker_id, lease=lease, **kwargs)
    return conn.execute(st.CLAIM, parameters).all()


def complete(conn: Connection, lease: Lease, result: Any) -> Sequence[Any]:
    return conn.execute(st.COMPLETE, st.complete_params([lease], [json.dumps(result)])).all()


def fail(
    conn: Connection,
    lease: Lease,
    delay: float | None,
    error: str | None = None,
) -> Sequence[Any]:
    document = error if error is not None else error_document("handler_error", ValueError("x"))
    return conn.execute(st.FAIL, st.fail_params([lease], [document], [delay])).all()


def renew(conn: Connection, lease: Lease, seconds: float = LEASE) -> Sequence[Any]:
    return conn.execute(st.RENEW, st.renew_params([lease], seconds)).all()


def release(conn: Connection, lease: Lease) -> Sequence[Any]:
    return conn.execute(st.RELEASE, st.release_params([lease])).all()


def recover(conn: Connection, limit: int = 100) -> Sequence[Any]:
    return conn.execute(st.RECOVER, {"limit": limit}).all()


def lease_of(row: Any) -> Lease:
    return Lease(row.id, row.attempt, row.lease_token)


# -- reading and arranging state -----------------------------------------------------------


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    """An autocommit connection, as the worker uses: every statement commits on its own."""
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


@pytest.fixture
def observer(pgtask_engine: Engine) -> Iterator[Connection]:
    """A second autocommit connection that only looks."""
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def add_task(engine: Engine, name: str = "job", **options: Any) -> uuid.UUID:
    with engine.begin() as conn:
        return enqueue(conn, name, {"n": 1}, **options).id


def expire_lease(conn: Connection, task_id: uuid.UUID) -> None:
    conn.execute(
        text(
            "UPDATE pgtask.tasks SET lease_expires_at = statement_timestamp() - interval '1 s'"
            " WHERE id = :id"
        ),
        {"id": task_id},
    )


def request_cancel(engine: Engine, task_id: uuid.UUID) -> str | None:
    with engine.begin() as conn:
        return cancel(conn, task_id)


# -- claim ---------------------------------------------------------------------------------


def test_claim_takes_a_lease_from_database_time_and_records_the_attempt(
    pgtask_engine: Engine, auto: Connection, observer: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=4)
    before = read_task(observer, task_id)

    [row] = claim(auto, lease=LEASE)

    # Committed by the statement itself: another connection sees it at once.
    after = read_task(observer, task_id)
    assert row.id == task_id
    assert (after["state"], after["attempt"], after["failed_attempts"]) == ("running", 1, 0)
    assert isinstance(after["lease_token"], uuid.UUID)
    assert after["lease_token"] == row.lease_token
    assert after["lease_owner"] == WORKER
    # The expiry is database time (the statement's own timestamp) plus the lease.
    assert after["updated_at"] > before["updated_at"]
    assert after["lease_expires_at"] == after["updated_at"] + timedelta(seconds=LEASE)
    assert after["completed_at"] is None
    [attempt] = read_attempts(observer, task_id)
    assert attempt == {
        "task_id": task_id, "attempt": 1, "lease_token": row.lease_token, "worker_id": WORKER,
        "state": "running", "started_at": after["updated_at"], "finished_at": None,
        "deadline_at": None, "error": None,
    }
    # The claim hands the handler what it needs.
    assert (row.name, row.version, row.payload, row.max_attempts) == ("job", 1, {"n": 1}, 4)
    assert row.cancel_requested_at is None
    # A claimed task is not claimed again while its lease holds.
    assert claim(auto) == []


def test_two_claimers_with_open_transactions_never_get_the_same_task(
    pgtask_engine: Engine,
) -> None:
    ids = {add_task(pgtask_engine) for _ in range(3)}
    with pgtask_engine.connect() as first, pgtask_engine.connect() as second, \
            pgtask_engine.connect() as third:
        for conn in (first, second, third):
            # A claimer that waited on a locked row instead of skipping it would fail here.
            conn.execute(text("SET lock_timeout = '2s'"))
        [a] = claim(first, limit=1)  # its transaction stays open, the row stays locked
        [b] = claim(second, limit=1)
        rest = claim(third, limit=10)
        assert claim(second, limit=10) == []  # the third claimer's row is locked too
        first.commit()
        second.commit()
        third.commit()
    claimed = [a.id, b.id, *(r.id for r in rest)]
    assert sorted(claimed) == sorted(ids)


def test_a_claimer_skips_a_task_locked_by_an_uncommitted_claim_instead_of_waiting(
    pgtask_engine: Engine,
) -> None:
    task_id = add_task(pgtask_engine)
    with pgtask_engine.connect() as first, pgtask_engine.connect() as second:
        second.execute(text("SET lock_timeout = '2s'"))
        [row] = claim(first)
        assert claim(second) == []
        first.rollback()  # the claim never happened: the task is pending again
        [again] = claim(second)
        second.commit()
    assert row.id == again.id == task_id
    assert again.attempt == 1  # the rolled-back claim left no trace


def test_racing_claimers_claim_every_task_exactly_once(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        for _ in range(4):
            for _ in range(30):
                enqueue(conn, "job", None)
    claimers = 4
    start = threading.Barrier(claimers)
    claimed: list[list[uuid.UUID]] = [[] for _ in range(claimers)]
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            engine = pgtask_engine.execution_options(isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                start.wait(timeout=10)
                while rows := claim(conn, limit=3, worker_id=uuid.uuid4()):
                    claimed[index] += [row.id for row in rows]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    everything = [task_id for ids in claimed for task_id in ids]
    assert len(everything) == 120
    assert len(set(everything)) == 120
    with pgtask_engine.connect() as conn:
        attempts = conn.execute(select(Task.attempt)).scalars().all()
    assert set(attempts) == {1}


def test_unknown_name_or_version_stays_pending_with_attempt_zero(
    pgtask_engine: Engine, auto: Connection
) -> None:
    other_name = add_task(pgtask_engine, "other")
    other_version = add_task(pgtask_engine, "job", version=2)
    known = add_task(pgtask_engine, "job", version=1)
    other_queue = add_task(pgtask_engine, "job", queue="elsewhere")
    before = {i: read_task(auto, i) for i in (other_name, other_version, other_queue)}

    rows = claim(auto, identities=[("job", 1)])

    assert [row.id for row in rows] == [known]
    for task_id, row in before.items():
        assert read_task(auto, task_id) == row
        assert row["state"] == "pending"
        assert row["attempt"] == 0
        assert read_attempts(auto, task_id) == []


def test_a_paused_queue_claims_nothing_until_resumed(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine)
    with pgtask_engine.begin() as conn:
        conn.execute(
            insert(Queue).values(name="default", paused_at=text("statement_timestamp()"))
        )
    assert claim(auto) == []
    assert read_task(auto, task_id)["state"] == "pending"
    auto.execute(update(Queue).where(Queue.name == "default").values(paused_at=None))
    assert [row.id for row in claim(auto)] == [task_id]


def test_claim_order_is_priority_first_then_oldest_run_at(
    pgtask_engine: Engine, auto: Connection
) -> None:
    offsets = {  # label: (priority, seconds from now)
        "low-oldest": (-3, -300), "mid-old": (0, -200), "mid-new": (0, -100),
        "high-new": (5, -10), "high-old": (5, -50), "future": (9, 3600),
    }
    ids = {}
    with pgtask_engine.begin() as conn:
        now = conn.execute(text("SELECT statement_timestamp()")).scalar_one()
        for label, (priority, seconds) in offsets.items():
            ids[enqueue(
                conn, "job", label, priority=priority, run_at=now + timedelta(seconds=seconds)
            ).id] = label
    order = []
    while rows := claim(auto, limit=1):
        order.append(ids[rows[0].id])
    # A task not due yet is not claimed, whatever its priority.
    assert order == ["high-old", "high-new", "mid-old", "mid-new", "low-oldest"]


def test_claim_returns_a_batch_in_priority_order(pgtask_engine: Engine, auto: Connection) -> None:
    with pgtask_engine.begin() as conn:
        by_id = {enqueue(conn, "job", p, priority=p).id: p for p in (1, 7, -2, 3)}
    rows = claim(auto, limit=10)
    assert [by_id[row.id] for row in rows] == [7, 3, 1, -2]


def test_the_retry_policy_is_snapshotted_at_first_claim_and_kept_on_later_claims(
    pgtask_engine: Engine, auto: Connection, observer: Connection
) -> None:
    task_id = add_task(pgtask_engine)
    assert read_task(observer, task_id)["retry_kind"] is None
    first_policy = RetryPolicy.exponential(base=3.0, factor=4.0, max=500.0, jitter=False)
    [first] = claim(auto, policy=first_policy)
    snapshot = ("exponential", 3.0, 4.0, 500.0, False)
    columns = ("retry_kind", "retry_base_seconds", "retry_factor", "retry_max_seconds",
               "retry_jitter")
    assert tuple(getattr(first, c) for c in columns) == snapshot
    assert fail(auto, lease_of(first), delay=0.0) == [(task_id, "pending")]

    # A later deploy registers another policy for the same handler: this task keeps its own.
    [second] = claim(auto, policy=RetryPolicy.fixed(9.0))
    assert second.attempt == 2
    assert tuple(getattr(second, c) for c in columns) == snapshot
    row = read_task(observer, task_id)
    assert tuple(row[c] for c in columns) == snapshot


# -- renewal -------------------------------------------------------------------------------


def test_renewal_extends_the_lease_from_database_time(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine)
    [row] = claim(auto, lease=5.0)
    assert renew(auto, lease_of(row), seconds=120.0) == [(task_id, False)]
    # RENEW does not touch updated_at, so measure against the database clock right after.
    now = auto.execute(text("SELECT statement_timestamp()")).scalar_one()
    expires = read_task(auto, task_id)["lease_expires_at"]
    assert timedelta(seconds=119) < expires - now <= timedelta(seconds=120)


def test_renewal_reports_a_cancel_request_and_keeps_the_lease(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine)
    [row] = claim(auto)
    assert request_cancel(pgtask_engine, task_id) == "running"
    assert renew(auto, lease_of(row)) == [(task_id, True)]
    assert read_task(auto, task_id)["state"] == "running"


# -- complete, fail, release ---------------------------------------------------------------


def test_complete_records_success_with_the_result_and_clears_the_lease(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine)
    [row] = claim(auto)
    assert complete(auto, lease_of(row), {"total": 42}) == [(task_id, "succeeded")]
    after = read_task(auto, task_id)
    assert after["state"] == "succeeded"
    assert after["result"] == {"total": 42}
    assert after["error"] is None
    assert (after["lease_token"], after["lease_owner"], after["lease_expires_at"]) == (
        None, None, None,
    )
    assert after["completed_at"] == after["updated_at"]
    assert (after["attempt"], after["failed_attempts"]) == (1, 0)
    [attempt] = read_attempts(auto, task_id)
    assert (attempt["state"], attempt["finished_at"], attempt["error"]) == (
        "succeeded", after["updated_at"], None,
    )


def test_fail_with_retry_reschedules_at_statement_time_plus_delay(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=3)
    [row] = claim(auto)
    document = error_document("handler_error", ValueError("flaky"))
    assert fail(auto, lease_of(row), delay=37.5, error=document) == [(task_id, "pending")]
    after = read_task(auto, task_id)
    assert after["state"] == "pending"
    # updated_at is the FAIL statement's statement_timestamp().
    assert after["run_at"] == after["updated_at"] + timedelta(seconds=37.5)
    assert (after["attempt"], after["failed_attempts"]) == (1, 1)
    assert after["error"] == json.loads(document)
    assert after["completed_at"] is None
    assert (after["lease_token"], after["lease_owner"], after["lease_expires_at"]) == (
        None, None, None,
    )
    [attempt] = read_attempts(auto, task_id)
    assert attempt["state"] == "failed"
    assert attempt["error"] == json.loads(document)
    assert attempt["finished_at"] == after["updated_at"]
    # Not due before run_at: nothing to claim now.
    assert claim(auto) == []


def test_fail_without_delay_is_terminal(pgtask_engine: Engine, auto: Connection) -> None:
    task_id = add_task(pgtask_engine, max_attempts=5)
    [row] = claim(auto)
    run_at = read_task(auto, task_id)["run_at"]
    assert fail(auto, lease_of(row), delay=None) == [(task_id, "failed")]
    after = read_task(auto, task_id)
    assert (after["state"], after["failed_attempts"], after["attempt"]) == ("failed", 1, 1)
    assert after["completed_at"] == after["updated_at"]
    assert after["run_at"] == run_at
    assert after["lease_token"] is None
    assert [a["state"] for a in read_attempts(auto, task_id)] == ["failed"]


def test_fail_with_delay_but_no_attempts_left_is_terminal(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=2)
    [first] = claim(auto)
    assert fail(auto, lease_of(first), delay=0.0) == [(task_id, "pending")]
    [second] = claim(auto)
    assert fail(auto, lease_of(second), delay=0.0) == [(task_id, "failed")]
    after = read_task(auto, task_id)
    assert (after["state"], after["failed_attempts"], after["attempt"]) == ("failed", 2, 2)
    assert after["completed_at"] == after["updated_at"]
    assert [a["state"] for a in read_attempts(auto, task_id)] == ["failed", "failed"]


def test_release_hands_the_task_back_without_counting_a_failure(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=1)
    [row] = claim(auto)
    assert release(auto, lease_of(row)) == [(task_id, "pending")]
    after = read_task(auto, task_id)
    assert (after["state"], after["attempt"], after["failed_attempts"]) == ("pending", 1, 0)
    assert after["run_at"] == after["updated_at"]  # due again at once
    assert after["lease_token"] is None
    assert after["completed_at"] is None
    [attempt] = read_attempts(auto, task_id)
    assert (attempt["state"], attempt["finished_at"]) == ("released", after["updated_at"])
    # Even with max_attempts=1 the task runs again: a release is not a failure.
    [again] = claim(auto)
    assert again.attempt == 2


@pytest.mark.parametrize("transition", ["complete", "fail-retry", "fail-terminal", "release"])
def test_a_cancel_request_wins_over_every_outcome_of_the_running_attempt(
    pgtask_engine: Engine, auto: Connection, transition: str
) -> None:
    task_id = add_task(pgtask_engine)
    [row] = claim(auto)
    assert request_cancel(pgtask_engine, task_id) == "running"
    if transition == "complete":
        written = complete(auto, lease_of(row), {"late": True})
    elif transition == "fail-retry":
        written = fail(auto, lease_of(row), delay=0.0)
    elif transition == "fail-terminal":
        written = fail(auto, lease_of(row), delay=None)
    else:
        written = release(auto, lease_of(row))
    assert written == [(task_id, "cancelled")]
    after = read_task(auto, task_id)
    assert after["state"] == "cancelled"
    assert after["result"] is None
    assert after["error"] == {"type": "cancelled"}
    assert after["failed_attempts"] == 0
    assert after["completed_at"] == after["updated_at"]
    assert [a["state"] for a in read_attempts(auto, task_id)] == ["cancelled"]


# -- fencing -------------------------------------------------------------------------------


@pytest.fixture
def reclaimed(
    pgtask_engine: Engine, auto: Connection
) -> tuple[uuid.UUID, tuple[uuid.UUID, int, uuid.UUID], tuple[uuid.UUID, int, uuid.UUID]]:
    """A task whose attempt 1 lost its lease, was recovered, and is now held by attempt 2."""
    task_id = add_task(pgtask_engine)
    [first] = claim(auto)
    expire_lease(auto, task_id)
    assert recover(auto) == [(task_id, "pending")]
    [second] = claim(auto, worker_id=uuid.uuid4())
    assert second.attempt == 2
    assert second.lease_token != first.lease_token
    return task_id, lease_of(first), lease_of(second)


def stale_write(conn: Connection, operation: str, lease: Lease) -> Sequence[Any]:
    if operation == "complete":
        return complete(conn, lease, {"stale": True})
    if operation == "fail-retry":
        return fail(conn, lease, delay=0.0)
    if operation == "fail-terminal":
        return fail(conn, lease, delay=None)
    if operation == "renew":
        return renew(conn, lease, seconds=3600.0)
    assert operation == "release"
    return release(conn, lease)


OPERATIONS = ["complete", "fail-retry", "fail-terminal", "renew", "release"]


def assert_no_write(
    conn: Connection, task_id: uuid.UUID, lease: Lease
) -> None:
    """Every operation with ``lease`` returns no id and leaves every row as it was.

    The operations run one after the other on the same rows: since none may write, each one
    starts from the same state.
    """
    before = (read_task(conn, task_id), read_attempts(conn, task_id))
    for operation in OPERATIONS:
        assert stale_write(conn, operation, lease) == [], f"{operation} was written"
        after = (read_task(conn, task_id), read_attempts(conn, task_id))
        assert after == before, f"{operation} changed a row"


def test_a_stale_attempt_cannot_write_after_its_lease_expired_and_the_task_was_reclaimed(
    auto: Connection, reclaimed: Any
) -> None:
    task_id, stale, _ = reclaimed
    assert_no_write(auto, task_id, stale)


@pytest.mark.parametrize("mismatch", ["attempt", "token"])
def test_every_part_of_the_fence_must_match(
    auto: Connection, reclaimed: Any, mismatch: str
) -> None:
    task_id, (_, _, stale_token), (_, attempt, token) = reclaimed
    if mismatch == "attempt":
        assert_no_write(auto, task_id, Lease(task_id, attempt - 1, token))
        assert_no_write(auto, task_id, Lease(task_id, attempt + 1, token))
    else:
        assert_no_write(auto, task_id, Lease(task_id, attempt, stale_token))
        assert_no_write(auto, task_id, Lease(task_id, attempt, uuid.uuid4()))
        assert_no_write(auto, task_id, Lease(task_id, attempt, cast(uuid.UUID, None)))


def test_the_fence_requires_the_running_state(auto: Connection, reclaimed: Any) -> None:
    task_id, _, current = reclaimed
    # A suspended attempt keeps id, attempt and token but is no longer running.
    auto.execute(update(Task).where(Task.id == task_id).values(state="waiting"))
    assert_no_write(auto, task_id, current)


def test_an_attempt_cannot_write_twice(auto: Connection, reclaimed: Any) -> None:
    task_id, _, current = reclaimed
    assert complete(auto, current, {"first": True}) == [(task_id, "succeeded")]
    assert_no_write(auto, task_id, current)


def test_the_current_attempt_still_writes_after_a_stale_one_was_refused(
    auto: Connection, reclaimed: Any
) -> None:
    task_id, stale, current = reclaimed
    assert complete(auto, stale, "stale") == []
    assert complete(auto, current, "current") == [(task_id, "succeeded")]
    assert read_task(auto, task_id)["result"] == "current"
    assert [a["state"] for a in read_attempts(auto, task_id)] == ["lost", "succeeded"]


def test_a_batch_writes_the_attempts_that_hold_their_lease_and_skips_the_rest(
    pgtask_engine: Engine, auto: Connection
) -> None:
    ids = [add_task(pgtask_engine) for _ in range(3)]
    rows = {row.id: row for row in claim(auto)}
    stolen = ids[1]
    auto.execute(update(Task).where(Task.id == stolen).values(lease_token=uuid.uuid4()))
    leases = [lease_of(rows[i]) for i in ids]
    params = st.complete_params(leases, [json.dumps(i) for i in range(3)])
    written = {row.id for row in auto.execute(st.COMPLETE, params)}
    assert written == {ids[0], ids[2]}
    assert read_task(auto, stolen)["state"] == "running"


@pytest.mark.parametrize("operation", OPERATIONS)
def test_fenced_writes_skip_a_row_another_transaction_holds_instead_of_waiting(
    pgtask_engine: Engine, auto: Connection, operation: str
) -> None:
    # cancel() inside a long business transaction holds the task row until it commits; the
    # worker's writes must not queue behind it (their lease would run out while they wait).
    held_id, free_id = add_task(pgtask_engine), add_task(pgtask_engine)
    rows = {row.id: row for row in claim(auto)}
    auto.execute(text("SET lock_timeout = '5s'"))  # a wait would fail the test, not hang it
    with pgtask_engine.connect() as business:
        assert cancel(business, held_id) == "running"  # uncommitted: the row stays locked
        assert stale_write(auto, operation, lease_of(rows[held_id])) == []
        assert [r.id for r in stale_write(auto, operation, lease_of(rows[free_id]))] == [free_id]
        business.commit()
    # The skipped attempt still holds its lease and writes once the row is free.
    assert [r.id for r in stale_write(auto, operation, lease_of(rows[held_id]))] == [held_id]


# -- recovery ------------------------------------------------------------------------------


def test_recovery_returns_an_expired_lease_to_pending_and_counts_a_failure(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=3)
    [row] = claim(auto)
    expire_lease(auto, task_id)
    assert recover(auto) == [(task_id, "pending")]
    after = read_task(auto, task_id)
    assert (after["state"], after["attempt"], after["failed_attempts"]) == ("pending", 1, 1)
    assert after["run_at"] == after["updated_at"]  # due again at once
    assert after["error"] == {"type": "lease_expired"}
    assert after["completed_at"] is None
    assert (after["lease_token"], after["lease_owner"], after["lease_expires_at"]) == (
        None, None, None,
    )
    [attempt] = read_attempts(auto, task_id)
    assert attempt["lease_token"] == row.lease_token
    assert (attempt["state"], attempt["error"]) == ("lost", {"type": "lease_expired"})
    assert attempt["finished_at"] == after["updated_at"]


def test_recovery_fails_a_task_with_no_attempts_left(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=1)
    claim(auto)
    expire_lease(auto, task_id)
    assert recover(auto) == [(task_id, "failed")]
    after = read_task(auto, task_id)
    assert (after["state"], after["failed_attempts"]) == ("failed", 1)
    assert after["completed_at"] == after["updated_at"]
    assert after["error"] == {"type": "lease_expired"}
    assert [a["state"] for a in read_attempts(auto, task_id)] == ["lost"]


def test_recovery_cancels_an_expired_task_whose_cancellation_was_requested(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=3)
    claim(auto)
    assert request_cancel(pgtask_engine, task_id) == "running"
    expire_lease(auto, task_id)
    assert recover(auto) == [(task_id, "cancelled")]
    after = read_task(auto, task_id)
    assert (after["state"], after["failed_attempts"]) == ("cancelled", 0)
    assert after["error"] == {"type": "cancelled"}
    assert after["completed_at"] == after["updated_at"]
    assert [a["state"] for a in read_attempts(auto, task_id)] == ["lost"]


def test_recovery_leaves_live_leases_alone(pgtask_engine: Engine, auto: Connection) -> None:
    task_id = add_task(pgtask_engine)
    claim(auto)
    before = read_task(auto, task_id)
    assert recover(auto) == []
    assert read_task(auto, task_id) == before


def test_recovery_works_in_bounded_batches_oldest_expiry_first(
    pgtask_engine: Engine, auto: Connection
) -> None:
    ids = [add_task(pgtask_engine) for _ in range(5)]
    claim(auto)
    for seconds, task_id in enumerate(ids):  # ids[0] expired longest ago
        auto.execute(
            text(
                "UPDATE pgtask.tasks SET lease_expires_at = statement_timestamp()"
                " - make_interval(secs => :s) WHERE id = :id"
            ),
            {"s": 10 - seconds, "id": task_id},
        )
    assert {row.id for row in recover(auto, limit=2)} == set(ids[:2])
    assert {row.id for row in recover(auto, limit=2)} == set(ids[2:4])
    assert {row.id for row in recover(auto, limit=2)} == {ids[4]}
    assert recover(auto, limit=2) == []


def test_a_skipped_recovery_does_not_block_on_a_row_locked_by_a_writer(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine)
    [row] = claim(auto)
    expire_lease(auto, task_id)
    with pgtask_engine.connect() as writer:
        # The owner's late COMPLETE is in flight and holds the row lock.
        assert complete(writer, lease_of(row), "in time") == [(task_id, "succeeded")]
        auto.execute(text("SET lock_timeout = '2s'"))
        assert recover(auto) == []  # skipped, not waited for
        writer.commit()
    assert read_task(auto, task_id)["state"] == "succeeded"
    assert recover(auto) == []


# -- whole histories -----------------------------------------------------------------------


def test_each_attempt_row_ends_in_the_state_of_its_own_ending(
    pgtask_engine: Engine, auto: Connection
) -> None:
    task_id = add_task(pgtask_engine, max_attempts=5)
    claim(auto)
    expire_lease(auto, task_id)
    recover(auto)  # attempt 1: lost
    [second] = claim(auto)
    fail(auto, lease_of(second), delay=0.0)  # attempt 2: failed, retried
    [third] = claim(auto)
    release(auto, lease_of(third))  # attempt 3: released at shutdown
    [fourth] = claim(auto)
    complete(auto, lease_of(fourth), "done")  # attempt 4: succeeded
    attempts = read_attempts(auto, task_id)
    assert [a["state"] for a in attempts] == ["lost", "failed", "released", "succeeded"]
    # The release is not a failure: it must not inherit the task's error of attempt 2.
    assert [a["error"] is None for a in attempts] == [False, False, True, True]
    assert all(a["finished_at"] is not None for a in attempts)
    assert len({a["lease_token"] for a in attempts}) == 4
    after = read_task(auto, task_id)
    assert (after["state"], after["attempt"], after["failed_attempts"]) == ("succeeded", 4, 2)


# -- error documents are storable ----------------------------------------------------------


#: Messages whose error documents must all be storable; the big ones are cut to fit.
MESSAGES = {
    "plain": "plain", "nul": "nul\x00inside", "surrogate": "lone \udc80 surrogate",
    "5M-nul": "\x00" * 5_000_000, "5M-surrogate": "\udc80" * 5_000_000,
    "3M-emoji": "\U0001f600" * 3_000_000, "5M-backslash": "\\" * 5_000_000,
    "5M-control": "\x01" * 5_000_000,
}


def test_every_error_document_is_accepted_by_jsonb_and_the_size_check(
    pgtask_engine: Engine, auto: Connection
) -> None:
    for label, message in MESSAGES.items():
        task_id = add_task(pgtask_engine)
        [row] = claim(auto)
        try:
            raise RuntimeError(message)
        except RuntimeError as exc:
            document = error_document("handler_error", exc)
        assert fail(auto, lease_of(row), delay=None, error=document) == [(task_id, "failed")], label
        stored = read_task(auto, task_id)["error"]
        assert stored == json.loads(document), label
        assert read_attempts(auto, task_id)[0]["error"] == stored, label
