"""`worker._set_aside.SetAside` on an injected clock: no database, no real time."""

from __future__ import annotations

import uuid

from sqlalchemy_pgtask.worker._set_aside import REST_FIRST, REST_MAX, SetAside
from tests.support.clocks import StoppedClock as Clock


def test_a_task_whose_rest_ended_never_makes_the_pass_run_back_to_back() -> None:
    # Its rest over but kept (for the doubling) while handled elsewhere: the pass that set it
    # aside must wait its interval, not be asked to run again at once for up to REST_MAX.
    clock = Clock()
    aside = SetAside("recovery", clock=clock)
    ended, resting = uuid.uuid4(), uuid.uuid4()
    aside.hold(ended, "statement_timeout")
    clock.now += REST_FIRST + 0.5
    assert aside.until_next() is None
    assert aside.resting() == []
    aside.hold(resting, "lock_not_available")
    clock.now += 0.25
    assert aside.until_next() == REST_FIRST - 0.25
    assert aside.resting() == [resting]


def test_rests_double_up_to_the_longest_and_a_released_task_starts_afresh() -> None:
    clock = Clock()
    aside = SetAside("wait timeout", clock=clock)
    task = uuid.uuid4()
    rests = []
    for _ in range(7):
        aside.hold(task, "lock_not_available")
        rests.append(aside.until_next())
        clock.now += REST_MAX
    assert rests == [1.0, 2.0, 4.0, 8.0, 16.0, REST_MAX, REST_MAX]
    aside.release([task])
    aside.hold(task, "lock_not_available")
    assert aside.until_next() == REST_FIRST
    assert len(aside) == 1
