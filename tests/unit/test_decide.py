"""The outcome decision: what a finished attempt writes, decided without a database.

`decide` maps what a handler returned or raised, and why the worker asked it to stop, to one
write (complete, fail with or without a retry delay, release) or to nothing (the lease is gone).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from sqlalchemy_pgtask import (
    DuplicateStep,
    Fail,
    LeaseLost,
    ReplayMismatch,
    Retry,
    RetryPolicy,
    TaskCancelled,
)
from sqlalchemy_pgtask.durable.context import StopReason
from sqlalchemy_pgtask.outcome import Outcome, decide

NO_JITTER = RetryPolicy.fixed(5.0, jitter=False)


class BadInput(Exception):
    pass


def run(
    *,
    returned: Any = None,
    raised: BaseException | None = None,
    stop: StopReason | None = None,
    stopped_by_worker: bool = False,
    policy: RetryPolicy = NO_JITTER,
    failed: int = 0,
) -> Outcome | None:
    return decide(
        returned=returned, raised=raised, stop=stop, stopped_by_worker=stopped_by_worker,
        policy=policy, failed_attempts=failed, non_retryable=(BadInput,),
        rng=random.Random(7),
    )


def document(outcome: Outcome | None) -> dict[str, Any]:
    assert outcome is not None
    assert outcome.document is not None
    parsed: dict[str, Any] = json.loads(outcome.document)
    return parsed


def test_a_returned_value_completes_with_it_as_the_result() -> None:
    outcome = run(returned={"total": 42})
    assert outcome is not None
    assert (outcome.kind, json.loads(outcome.document or "")) == ("complete", {"total": 42})


def test_a_value_that_cannot_be_stored_fails_for_good_as_result_rejected() -> None:
    outcome = run(returned=object())
    assert outcome is not None
    assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", None, "result_rejected")


def test_an_exception_fails_and_retries_after_the_policys_delay() -> None:
    outcome = run(raised=ValueError("boom"), failed=2)
    assert outcome is not None
    assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", 5.0, "handler_error")
    assert document(outcome)["exception"] == "ValueError"


def test_an_exception_under_a_never_policy_fails_for_good() -> None:
    outcome = run(raised=ValueError("boom"), policy=RetryPolicy.never())
    assert outcome is not None
    assert (outcome.kind, outcome.delay) == ("fail", None)


def test_the_delay_grows_with_the_failures_before_this_one() -> None:
    policy = RetryPolicy.exponential(base=1.0, factor=2.0, max=60.0, jitter=False)
    delays = [run(raised=ValueError(), policy=policy, failed=n) for n in range(4)]
    assert [d.delay for d in delays if d is not None] == [1.0, 2.0, 4.0, 8.0]


def test_fail_fails_for_good_whatever_attempts_remain() -> None:
    outcome = run(raised=Fail("order deleted"))
    assert outcome is not None
    assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", None, "fail")


def test_a_non_retryable_exception_fails_for_good() -> None:
    outcome = run(raised=BadInput("malformed"))
    assert outcome is not None
    assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", None, "non_retryable")


def test_retry_uses_its_own_delay_or_else_the_policys() -> None:
    own, policy_delay = run(raised=Retry(delay=30)), run(raised=Retry())
    assert own is not None
    assert policy_delay is not None
    assert (own.delay, own.error_kind) == (30.0, "retry")
    assert policy_delay.delay == 5.0


def test_retry_under_a_never_policy_retries_at_once() -> None:
    outcome = run(raised=Retry(), policy=RetryPolicy.never())
    assert outcome is not None
    assert (outcome.kind, outcome.delay) == ("fail", 0.0)


@pytest.mark.parametrize(
    "raised",
    [None, ValueError("late"), asyncio.CancelledError(), LeaseLost()],
    ids=["returned", "raised", "cancelled", "lease-lost"],
)
def test_a_lost_lease_writes_nothing_whatever_the_handler_did(
    raised: BaseException | None,
) -> None:
    assert run(returned="late", raised=raised, stop="lease_lost", stopped_by_worker=True) is None


@pytest.mark.parametrize("stop", ["shutdown", "lease_expiring"])
def test_a_handler_stopped_to_hand_its_task_back_is_released(stop: StopReason) -> None:
    outcome = run(raised=asyncio.CancelledError(), stop=stop, stopped_by_worker=True)
    assert outcome == Outcome("release")


@pytest.mark.parametrize("stop", ["shutdown", "lease_expiring"])
def test_a_sync_handler_that_saw_its_stop_request_is_released(stop: StopReason) -> None:
    assert run(raised=LeaseLost(), stop=stop) == Outcome("release")


def test_a_cancelled_task_is_recorded_as_cancelled() -> None:
    for outcome in (
        run(raised=asyncio.CancelledError(), stop="cancelled", stopped_by_worker=True),
        run(raised=TaskCancelled(), stop="cancelled"),
    ):
        assert outcome is not None
        assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", None, "cancelled")


def test_a_handler_that_finishes_despite_a_stop_request_still_reports_its_outcome() -> None:
    # The fenced statement decides: a cancel request turns a success into cancelled.
    outcome = run(returned="done anyway", stop="shutdown")
    assert outcome is not None
    assert outcome.kind == "complete"


def test_a_cancelled_error_the_handler_raised_itself_is_a_failure_retried_by_policy() -> None:
    outcome = run(raised=asyncio.CancelledError("gave up"), stopped_by_worker=False)
    assert outcome is not None
    assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", 5.0, "handler_error")
    assert document(outcome)["exception"] == "asyncio.exceptions.CancelledError"


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_base_exceptions_from_a_handler_are_failures_too(exc: BaseException) -> None:
    outcome = run(raised=exc)
    assert outcome is not None
    assert (outcome.kind, outcome.error_kind) == ("fail", "handler_error")


class RateLimited(Retry):
    """A Retry subclass that never calls ``Retry.__init__``: it has no ``delay``."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after


class ExactRetry(Retry):
    def __init__(self, delay: object) -> None:
        super().__init__("again")
        self.delay = delay  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("raised", "delay"),
    [(RateLimited(3.0), 5.0), (ExactRetry(-1.0), 5.0), (ExactRetry(float("inf")), 5.0),
     (ExactRetry("soon"), 5.0), (ExactRetry(12), 12.0)],
    ids=["no-init", "negative", "infinite", "not-a-number", "int"],
)
def test_a_retry_subclass_delay_is_checked_and_falls_back_to_the_policy(
    raised: Retry, delay: float
) -> None:
    outcome = run(raised=raised)
    assert outcome is not None
    assert (outcome.kind, outcome.error_kind, outcome.delay) == ("fail", "retry", delay)


class UnreadableDelay(Retry):
    def __init__(self) -> None:
        Exception.__init__(self, "later")  # Retry.__init__ would set the delay

    @property
    def delay(self) -> float:  # type: ignore[override]
        raise RuntimeError("the rate limiter is gone")


class UnprintableMessage(Exception):
    def __str__(self) -> str:
        raise LookupError("no translation for this message")


@pytest.mark.parametrize(
    "raised", [UnreadableDelay(), UnprintableMessage()], ids=["retry-delay", "message"]
)
def test_an_outcome_that_cannot_be_read_is_a_handler_error_retried_by_policy(
    raised: BaseException,
) -> None:
    # Reading the outcome runs the handler's own code; what that raises escaped decide(), and
    # the worker wrote nothing: the task stayed running until its lease expired.
    outcome = run(raised=raised)
    assert outcome is not None
    assert (outcome.kind, outcome.error_kind, outcome.delay) == ("fail", "handler_error", 5.0)
    assert document(outcome)["type"] == "handler_error"


def _raised_from(cause: BaseException, wrapper: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as exc:
            raise wrapper from exc
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ReplayMismatch("step 'a': stored as a step, not a sleep"), "replay_mismatch"),
        (DuplicateStep("step", "'a' (occurrence 0) was already used in this run"),
         "duplicate_step"),
    ],
)
def test_a_durable_call_that_can_never_replay_fails_for_good(
    error: BaseException, kind: str
) -> None:
    # Deterministic: every retry would run into it again. So does a handler's own error
    # raised from it; an explicit Retry is the handler's to ask for, and is obeyed.
    for raised in (error, _raised_from(error, LookupError("could not go on"))):
        outcome = run(raised=raised)
        assert outcome is not None
        assert (outcome.kind, outcome.delay, outcome.error_kind) == ("fail", None, kind)
        assert document(outcome)["type"] == kind
    asked = run(raised=_raised_from(error, Retry(delay=1.0)))
    assert asked is not None
    assert (asked.error_kind, asked.delay) == ("retry", 1.0)
