"""How many tasks a worker claims ahead of its free slots (`worker._prefetch.Prefetch`).

Pure policy, driven with explicit monotonic times: how the recent pace of finished handlers
sets the target, when a claim asks for more than the free slots, and which waiting rows are
stale.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from sqlalchemy_pgtask import InvalidOptionError, WorkerOptions
from sqlalchemy_pgtask.statements import Lease
from sqlalchemy_pgtask.worker._prefetch import HORIZON, MAX_WAIT, WINDOW, Prefetch, Waiting

T0 = 1_000.0


class FakeRow:
    """The columns of a claimed row the wait reads: its lease and its time limit."""

    def __init__(self, time_limit: float | None = None) -> None:
        self.id = uuid.uuid4()
        self.attempt = 1
        self.lease_token = uuid.uuid4()
        self.time_limit = time_limit


def rows(count: int, time_limit: float | None = None) -> list[Any]:
    return [FakeRow(time_limit) for _ in range(count)]


def leases(waiting: list[Waiting]) -> list[Lease]:
    return [w.lease for w in waiting]


def finish(prefetch: Prefetch, count: int, start: float, spread: float) -> float:
    """``count`` handlers finishing evenly over ``spread`` seconds from ``start``; the last
    finish's time."""
    at = start
    for i in range(count):
        at = start + spread * i / max(count - 1, 1)
        prefetch.finished(at)
    return at


def test_nothing_is_claimed_ahead_before_a_handler_finished() -> None:
    prefetch = Prefetch(100, 30.0)
    assert prefetch.target(T0) == 0
    assert prefetch.claim_size(3, T0, ahead=True) == 3


def test_the_target_is_the_work_of_one_horizon_at_the_pace_of_the_last_window() -> None:
    prefetch = Prefetch(1_000, 30.0)
    last = finish(prefetch, 400, T0, WINDOW * 0.9)  # 400 in 0.9 s
    assert prefetch.target(last) == int(400 * HORIZON / WINDOW)


def test_the_target_is_capped_by_the_limit() -> None:
    prefetch = Prefetch(7, 30.0)
    last = finish(prefetch, 2_000, T0, 0.5)
    assert prefetch.target(last) == 7


def test_a_limit_of_0_never_claims_ahead() -> None:
    prefetch = Prefetch(0, 30.0)
    last = finish(prefetch, 2_000, T0, 0.5)
    assert prefetch.target(last) == 0
    assert prefetch.claim_size(2, last, ahead=True) == 2


def test_no_finish_within_the_horizon_means_nothing_starts_soon() -> None:
    prefetch = Prefetch(100, 30.0)
    last = finish(prefetch, 2_000, T0, 0.5)
    assert prefetch.target(last + HORIZON / 2) > 0
    # Slots held by handlers that run on: the earlier pace promises nothing.
    assert prefetch.target(last + HORIZON * 1.5) == 0


def test_finishes_older_than_the_window_no_longer_count() -> None:
    prefetch = Prefetch(1_000, 30.0)
    finish(prefetch, 1_000, T0, 0.2)
    late = T0 + WINDOW + 0.5
    prefetch.finished(late)
    assert prefetch.target(late) == int(1 * HORIZON / WINDOW)  # only the latest one counts


def test_the_window_forgets_its_oldest_buckets_one_by_one() -> None:
    prefetch = Prefetch(1_000, 30.0)
    finish(prefetch, 200, T0, 0.0)  # one bucket
    later = finish(prefetch, 200, T0 + 0.5, 0.0)  # another, half a window on
    assert prefetch.target(later) == int(400 * HORIZON / WINDOW)
    # Past the window of the first bucket, not of the second.
    read_at = T0 + WINDOW + HORIZON
    prefetch.finished(read_at)
    assert prefetch.target(read_at) == int(201 * HORIZON / WINDOW)


def test_a_claim_asks_for_the_free_slots_plus_the_target_less_what_waits() -> None:
    prefetch = Prefetch(100, 30.0)
    last = finish(prefetch, 1_000, T0, 0.4)
    target = prefetch.target(last)
    assert target == 50
    assert prefetch.claim_size(4, last, ahead=True) == 4 + target
    prefetch.add(rows(target // 4), last - 0.001, last)
    assert prefetch.claim_size(0, last, ahead=True) == target - target // 4


def test_no_claim_ahead_while_more_than_a_quarter_of_the_target_waits() -> None:
    prefetch = Prefetch(100, 30.0)
    last = finish(prefetch, 1_000, T0, 0.4)
    prefetch.add(rows(prefetch.target(last) // 4 + 1), last - 0.001, last)
    assert prefetch.claim_size(0, last, ahead=True) == 0


def test_no_claim_ahead_when_the_caller_says_not_to() -> None:
    """(The claim loop says so for governed queues and when the outcome writer is behind.)"""
    prefetch = Prefetch(100, 30.0)
    last = finish(prefetch, 1_000, T0, 0.4)
    assert prefetch.claim_size(3, last, ahead=False) == 3
    assert prefetch.claim_size(0, last, ahead=False) == 0


def test_rows_are_stale_after_the_longest_wait() -> None:
    prefetch = Prefetch(100, 2.0)
    assert prefetch.max_wait == 0.5  # a quarter of the lease: waiting leases are not renewed
    prefetch.add(rows(1), T0 - 0.001, T0)
    prefetch.add(rows(2), T0 + 0.099, T0 + 0.1)
    assert prefetch.until_stale(T0) == pytest.approx(0.5)
    assert prefetch.take_stale(T0 + 0.45) == []
    first = prefetch.take_stale(T0 + 0.55)
    assert len(first) == 1
    assert first[0].arrived == T0
    assert len(prefetch) == 2
    assert len(prefetch.take_stale(T0 + 0.65)) == 2
    assert len(prefetch) == 0


def test_a_row_with_a_time_limit_is_stale_after_a_quarter_of_it() -> None:
    """Its limit runs from its claim: waiting must not eat the attempt's time."""
    prefetch = Prefetch(100, 30.0)
    assert prefetch.max_wait == MAX_WAIT
    prefetch.add(rows(1, time_limit=0.4), T0 - 0.001, T0)
    prefetch.add(rows(1, time_limit=60.0), T0 - 0.001, T0)
    prefetch.add(rows(1), T0 - 0.001, T0)
    assert prefetch.until_stale(T0) == pytest.approx(0.1)
    stale = prefetch.take_stale(T0 + 0.15)
    assert [w.row.time_limit for w in stale] == [0.4]
    assert [w.row.time_limit for w in prefetch.take_stale(T0 + MAX_WAIT)] == [60.0, None]


def test_rows_are_taken_in_claim_order_and_held_until_taken() -> None:
    prefetch = Prefetch(100, 30.0)
    claimed = rows(3)
    prefetch.add(claimed, T0 - 0.001, T0)
    held = [Lease(r.id, r.attempt, r.lease_token) for r in claimed]
    assert all(prefetch.holds(lease) for lease in held)
    assert not prefetch.holds(Lease(claimed[0].id, 2, claimed[0].lease_token))
    first = prefetch.take(2)
    assert leases(first) == held[:2]
    assert not prefetch.holds(held[0])
    assert prefetch.holds(held[2])
    assert leases(prefetch.take(5)) == held[2:]
    assert len(prefetch) == 0
    assert prefetch.until_stale(T0) is None


@pytest.mark.parametrize("value", [-1, 100_001, 1.5, True, "10", None])
def test_worker_options_refuse_a_prefetch_that_is_no_count_in_range(value: object) -> None:
    with pytest.raises(InvalidOptionError, match="prefetch"):
        WorkerOptions(prefetch=value)  # type: ignore[arg-type]


def test_worker_options_accept_a_prefetch_of_0_to_100_000() -> None:
    assert [WorkerOptions(prefetch=n).prefetch for n in (0, 1, 100_000)] == [0, 1, 100_000]
