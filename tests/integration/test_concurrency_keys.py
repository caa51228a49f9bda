"""Concurrency keys (issue 26): the claim itself never lets more than the limit of one (queue,
name, key) hold the key, takes a key's tasks in claim order, passes over full keys, and every
way out of running releases the key by changing the state.

The worker's own statements run directly here, over autocommit connections as the worker
uses them; time is moved in the database, never slept.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, insert, select, text, update

from sqlalchemy_pgtask import (
    EnqueueRequest,
    HandlerPolicy,
    InvalidNameError,
    InvalidOptionError,
    Registry,
    Task,
    cancel,
    enqueue,
    enqueue_many,
)
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.worker._metrics import QUEUE_BACKLOG
from tests.support.durable import (
    claim,
    claim_one,
    complete,
    expire_lease,
    fail,
    recover,
    sleep,
    waiting_on_signal,
)

KEY = "customer-42"


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def add(conn: Connection, key: str | None = KEY, **options: Any) -> uuid.UUID:
    return enqueue(conn, "job", None, concurrency_key=key, **options).id


def holders(conn: Connection, key: str = KEY) -> set[uuid.UUID]:
    rows = conn.execute(
        select(Task.id).where(
            Task.concurrency_key == key,
            (Task.state == "running") | Task.concurrency_held,
        )
    )
    return set(rows.scalars())


def freeze_policy(conn: Connection, *, limit: int | None = None, scope: str = "workflow") -> None:
    """The policy a worker registering ("default", "job", 1) would freeze."""
    conn.execute(
        insert(HandlerPolicy).values(
            queue="default", name="job", version=1, retry_kind="never", retry_jitter=False,
            max_attempts=5, concurrency_limit=limit, concurrency_scope=scope,
        )
    )


def claimed_ids(conn: Connection, **kwargs: Any) -> list[uuid.UUID]:
    return [lease.task_id for lease in claim(conn, **kwargs)]


# -- limits ----------------------------------------------------------------------------------


def test_one_task_of_a_key_runs_at_a_time_by_default(auto: Connection) -> None:
    first, _, _ = (add(auto) for _ in range(3))
    assert claimed_ids(auto) == [first]
    assert claimed_ids(auto) == []
    assert holders(auto) == {first}


def test_a_tasks_own_limit_lets_that_many_hold_the_key(auto: Connection) -> None:
    ids = [add(auto, concurrency_limit=2) for _ in range(4)]
    assert claimed_ids(auto) == ids[:2]
    assert claimed_ids(auto) == []


def test_the_handlers_frozen_limit_applies_to_tasks_without_their_own(auto: Connection) -> None:
    freeze_policy(auto, limit=3)
    ids = [add(auto) for _ in range(5)]
    assert sorted(claimed_ids(auto)) == sorted(ids[:3])
    assert claimed_ids(auto) == []


def test_tasks_without_a_key_and_other_keys_are_not_limited(auto: Connection) -> None:
    keyed = [add(auto) for _ in range(2)]
    plain = [add(auto, None) for _ in range(2)]
    other = add(auto, "customer-7")
    assert set(claimed_ids(auto)) == {keyed[0], *plain, other}


# -- order and fairness ----------------------------------------------------------------------


def test_a_keys_tasks_start_in_priority_then_run_at_then_id_order(auto: Connection) -> None:
    low = add(auto)
    high = add(auto, priority=5)
    later = add(auto, priority=5)
    order = []
    for _ in range(3):
        lease = claim_one(auto)
        order.append(lease.task_id)
        assert claimed_ids(auto) == []
        complete(auto, lease)
    assert order == [high, later, low]


def test_a_hot_keys_backlog_does_not_hold_back_other_keys_in_one_claim(
    auto: Connection,
) -> None:
    hot = enqueue_many(
        auto, [EnqueueRequest(name="job", concurrency_key="hot", priority=9)] * 2000
    )
    cold = [add(auto, f"cold-{n}") for n in range(5)]
    plain = add(auto, None)
    claimed = set(claimed_ids(auto, limit=10))
    # One run_at for the whole batch: the key's first in line is its lowest id.
    assert claimed == {min(r.id for r in hot), *cold, plain}


# -- holding and releasing -------------------------------------------------------------------


def test_a_durable_sleep_keeps_the_key_and_its_task_takes_it_back(auto: Connection) -> None:
    first, second = add(auto), add(auto)
    lease = claim_one(auto)
    assert sleep(auto, lease, "nap", delay=3600).suspended
    assert holders(auto) == {first}
    assert claimed_ids(auto) == []
    auto.execute(update(Task).where(Task.id == first).values(run_at=func.pgtask.now()))
    again = claim_one(auto)
    assert again.task_id == first
    complete(auto, again)
    assert holders(auto) == set()
    assert claimed_ids(auto) == [second]


def test_a_signal_wait_keeps_the_key(auto: Connection) -> None:
    first = add(auto)
    add(auto)
    waiting_on_signal(auto, claim_one(auto), "wait", "approved")
    assert holders(auto) == {first}
    assert claimed_ids(auto) == []


def test_cancelling_a_suspended_holder_releases_its_key(auto: Connection) -> None:
    first, second = add(auto), add(auto)
    sleep(auto, claim_one(auto), "nap", delay=3600)
    assert cancel(auto, first) == "cancelled"
    row = auto.execute(select(Task.concurrency_held).where(Task.id == first)).scalar_one()
    assert row is False
    assert claimed_ids(auto) == [second]


def test_scope_running_releases_the_key_during_a_suspension(auto: Connection) -> None:
    freeze_policy(auto, scope="running")
    add(auto)
    second = add(auto)
    sleep(auto, claim_one(auto), "nap", delay=3600)
    assert holders(auto) == set()
    assert claimed_ids(auto) == [second]


def test_a_retry_backoff_releases_the_key(auto: Connection) -> None:
    add(auto)
    second = add(auto)
    fail(auto, claim_one(auto), 3600.0)
    assert claimed_ids(auto) == [second]


def test_a_fenced_hand_back_releases_the_key(auto: Connection) -> None:
    add(auto)
    second = add(auto)
    lease = claim_one(auto)
    auto.execute(st.RELEASE, st.release_params([lease]))
    assert holders(auto) == set()
    # Due again from now: behind the task that waited since before.
    assert claimed_ids(auto) == [second]


def test_lease_expiry_releases_the_key(auto: Connection) -> None:
    add(auto)
    second = add(auto)
    expire_lease(auto, claim_one(auto).task_id)
    assert claimed_ids(auto) == []
    recover(auto)  # the lost attempt failed: the task waits for its retry backoff
    assert holders(auto) == set()
    assert claimed_ids(auto) == [second]


def test_a_stale_holders_fenced_write_cannot_release_a_key_a_newer_attempt_holds(
    auto: Connection,
) -> None:
    first = add(auto)
    stale = claim_one(auto)
    expire_lease(auto, first)
    recover(auto)
    auto.execute(update(Task).where(Task.id == first).values(run_at=func.pgtask.now()))
    newer = claim_one(auto)
    assert (newer.task_id, newer.attempt) == (first, stale.attempt + 1)
    add(auto)
    assert complete(auto, stale) == []
    fail(auto, stale, 0.0)
    auto.execute(st.RELEASE, st.release_params([stale]))
    assert holders(auto) == {first}
    assert claimed_ids(auto) == []


def test_the_sampled_backlog_counts_the_tasks_waiting_for_their_key(auto: Connection) -> None:
    for _ in range(3):
        add(auto)
    add(auto, None)

    def waiting() -> int:
        row = auto.execute(QUEUE_BACKLOG, {"queues": ["default"]}).one()
        return int(row.key_waiting)

    assert waiting() == 2  # the first of the key may take it
    claim_one(auto)
    assert waiting() == 2  # it holds the key: the other two wait


# -- the grant under the key's lock ----------------------------------------------------------


def _start(conn: Connection, task_id: uuid.UUID) -> int:
    """Turn a task running as a raw claimer would, past the claim's own filter."""
    result = conn.execute(
        text(
            "UPDATE pgtask.tasks SET state = 'running', attempt = attempt + 1,"
            " lease_token = gen_random_uuid(), lease_owner = gen_random_uuid(),"
            " lease_expires_at = pgtask.now() + interval '1 min', max_attempts = 5"
            " WHERE id = :id"
        ),
        {"id": task_id},
    )
    return result.rowcount


def test_a_key_at_its_limit_is_never_granted_again(auto: Connection) -> None:
    add(auto)
    second = add(auto)
    claim_one(auto)
    assert _start(auto, second) == 0
    assert auto.execute(select(Task.state).where(Task.id == second)).scalar_one() == "pending"


def test_a_grant_in_flight_makes_a_concurrent_grant_of_its_key_skip(
    auto: Connection, pgtask_engine: Engine
) -> None:
    first = add(auto, concurrency_limit=2)
    second = add(auto, concurrency_limit=2)
    with pgtask_engine.connect() as granting:
        [lease] = claim(granting, limit=1)
        assert lease.task_id == first
        # Uncommitted: the key's lock is held, so the other grant skips rather than wait.
        assert _start(auto, second) == 0
        granting.commit()
    assert claimed_ids(auto) == [second]


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "x" * 513, "a\x00b", 42])
def test_a_bad_key_is_refused_before_any_sql(auto: Connection, key: Any) -> None:
    with pytest.raises(InvalidNameError, match="concurrency_key"):
        add(auto, key)
    with pytest.raises(InvalidNameError, match=r"\[0\]\.concurrency_key"):
        enqueue_many(auto, [EnqueueRequest(name="job", concurrency_key=key)])
    assert auto.execute(select(func.count()).select_from(Task)).scalar_one() == 0


@pytest.mark.parametrize(
    ("key", "limit"), [(KEY, 0), (KEY, True), (KEY, 2**31), (KEY, "2"), (None, 2)]
)
def test_a_bad_limit_is_refused_before_any_sql(
    auto: Connection, key: str | None, limit: Any
) -> None:
    with pytest.raises(InvalidOptionError, match="concurrency_limit"):
        add(auto, key, concurrency_limit=limit)
    assert auto.execute(select(func.count()).select_from(Task)).scalar_one() == 0


@pytest.mark.parametrize(
    "options",
    [{"concurrency_limit": 0}, {"concurrency_limit": 1.5}, {"concurrency_scope": "task"}],
)
def test_a_bad_definition_policy_is_refused_at_registration(options: dict[str, Any]) -> None:
    registry = Registry()
    with pytest.raises(InvalidOptionError, match="concurrency_"):
        registry.task("job", **options)
