"""Retry policies: the ceiling after n failed attempts, its cap, jitter and validation.

Pure maths: no database. The worker computes ``delay(failed_attempts + 1)`` when an attempt
fails and hands the result to the FAIL statement, so these numbers are the waits users get.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable

import pytest

from sqlalchemy_pgtask import InvalidOptionError, RetryPolicy
from sqlalchemy_pgtask.registry import DEFAULT_RETRY
from sqlalchemy_pgtask.validation import DURATION_MAX_SECONDS

INT4_MAX = 2**31 - 1


# -- ceilings ------------------------------------------------------------------------------


def test_never_policy_has_no_retry_for_any_failure_count() -> None:
    policy = RetryPolicy.never()
    for failures in (1, 2, 10, INT4_MAX):
        assert policy.ceiling(failures) is None
        assert policy.delay(failures, random.Random(1)) is None


def test_fixed_policy_ceiling_is_the_delay_whatever_the_failure_count() -> None:
    policy = RetryPolicy.fixed(7.5)
    assert [policy.ceiling(n) for n in (1, 2, 3, 100, INT4_MAX)] == [7.5] * 5


def test_exponential_ceiling_grows_by_factor_from_the_failed_attempt_count() -> None:
    policy = RetryPolicy.exponential(base=1.0, factor=2.0, max=1000.0)
    # The first failure waits ``base``; each later one multiplies by ``factor``.
    assert [policy.ceiling(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    tripling = RetryPolicy.exponential(base=0.5, factor=3.0, max=1000.0)
    assert [tripling.ceiling(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 4.5, 13.5]


def test_exponential_ceiling_is_capped_at_max() -> None:
    policy = RetryPolicy.exponential(base=1.0, factor=2.0, max=60.0)
    assert [policy.ceiling(n) for n in range(5, 10)] == [16.0, 32.0, 60.0, 60.0, 60.0]


def test_the_default_policy_is_exponential_from_one_second_to_a_minute() -> None:
    assert DEFAULT_RETRY.kind == "exponential"
    assert DEFAULT_RETRY.ceiling(1) == 1.0
    assert DEFAULT_RETRY.ceiling(50) == 60.0
    assert DEFAULT_RETRY.jitter


@pytest.mark.parametrize("failures", [64, 1025, 10_000, INT4_MAX, 10**18])
@pytest.mark.parametrize(
    "policy",
    [
        RetryPolicy.exponential(base=1.0, factor=2.0, max=60.0),
        RetryPolicy.exponential(base=0.001, factor=10.0, max=86_400.0),
        RetryPolicy.exponential(base=2.0, factor=1e300, max=DURATION_MAX_SECONDS),
    ],
    ids=["default-shape", "steep", "longest-max"],
)
def test_exponential_ceiling_saturates_at_max_without_overflow(
    policy: RetryPolicy, failures: int
) -> None:
    # factor ** (failures - 1) is far beyond a float here; the cap must win, not OverflowError.
    assert policy.ceiling(failures) == policy.max_seconds
    assert policy.delay(failures, random.Random(0)) is not None


def test_exponential_ceiling_saturates_even_when_max_over_base_overflows() -> None:
    # check_seconds accepts any finite non-negative base, including subnormal floats.
    policy = RetryPolicy.exponential(base=1e-309, factor=2.0, max=1.0, jitter=False)
    assert policy.ceiling(1) == 1e-309
    assert policy.ceiling(10_000) == 1.0


def test_factor_one_keeps_the_base_delay() -> None:
    policy = RetryPolicy.exponential(base=3.0, factor=1.0, max=10.0)
    assert [policy.ceiling(n) for n in (1, 2, 1000, INT4_MAX)] == [3.0] * 4


@pytest.mark.parametrize(
    "failures",
    [1, 2, 40, 1024, 1025, 10_000, INT4_MAX],
)
def test_zero_base_means_retry_at_once_for_every_failure_count(failures: int) -> None:
    # base * factor ** n is 0 for every n, however large: the cap never comes into it.
    assert RetryPolicy.exponential(base=0.0, factor=2.0, max=60.0).ceiling(failures) == 0.0
    assert RetryPolicy.exponential(base=0.0, factor=2.0, max=0.0).ceiling(failures) == 0.0
    assert RetryPolicy.fixed(0.0).ceiling(failures) == 0.0


@pytest.mark.parametrize("failures", [0, -1])
@pytest.mark.parametrize(
    "policy", [RetryPolicy.never(), RetryPolicy.fixed(1.0), RetryPolicy.exponential()]
)
def test_ceiling_counts_the_failure_just_recorded_so_it_is_at_least_one(
    policy: RetryPolicy, failures: int
) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        policy.ceiling(failures)


# -- jitter --------------------------------------------------------------------------------


def test_full_jitter_stays_within_zero_and_the_ceiling() -> None:
    policy = RetryPolicy.exponential(base=1.0, factor=2.0, max=30.0)
    rng = random.Random(20240601)
    for failures in range(1, 12):
        ceiling = policy.ceiling(failures)
        assert ceiling is not None
        delays = [policy.delay(failures, rng) for _ in range(200)]
        assert all(d is not None and 0.0 <= d <= ceiling for d in delays)


def test_full_jitter_spreads_delays_over_the_whole_window() -> None:
    policy = RetryPolicy.fixed(10.0)
    rng = random.Random(7)
    delays = [policy.delay(1, rng) for _ in range(1000)]
    values = [d for d in delays if d is not None]
    assert len(values) == 1000
    assert len(set(values)) > 990  # it actually varies
    # Uniform over [0, 10]: both the low and the high tenth are hit, the mean is near 5.
    assert min(values) < 1.0
    assert max(values) > 9.0
    assert 4.5 < sum(values) / len(values) < 5.5


def test_jitter_is_reproducible_with_a_seeded_rng() -> None:
    policy = RetryPolicy.exponential(base=1.0, factor=2.0, max=60.0)
    first = [policy.delay(n, random.Random(99)) for n in range(1, 10)]
    second = [policy.delay(n, random.Random(99)) for n in range(1, 10)]
    assert first == second


def test_delay_without_an_rng_uses_the_module_rng_and_stays_in_range() -> None:
    policy = RetryPolicy.fixed(2.0)
    delays = {policy.delay(1) for _ in range(50)}
    assert all(d is not None and 0.0 <= d <= 2.0 for d in delays)
    assert len(delays) > 1


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (RetryPolicy.fixed(2.5, jitter=False), [2.5, 2.5, 2.5, 2.5]),
        (
            RetryPolicy.exponential(base=0.5, factor=2.0, max=3.0, jitter=False),
            [0.5, 1.0, 2.0, 3.0],
        ),
    ],
)
def test_without_jitter_the_delay_is_exactly_the_ceiling(
    policy: RetryPolicy, expected: list[float]
) -> None:
    rng = random.Random(3)
    assert [policy.delay(n, rng) for n in (1, 2, 3, 4)] == expected


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factor", [0.5, 0.0, -2.0, math.nan, math.inf, 2**1100, -(2**1100)],
    ids=["half", "zero", "negative", "nan", "inf", "int-beyond-float", "negative-int-beyond-float"],
)
def test_exponential_factor_must_be_finite_and_at_least_one(factor: float) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        RetryPolicy.exponential(base=1.0, factor=factor, max=10.0)
    assert caught.value.field == "retry.factor"


def test_exponential_max_must_not_be_smaller_than_base() -> None:
    with pytest.raises(InvalidOptionError) as caught:
        RetryPolicy.exponential(base=10.0, factor=2.0, max=5.0)
    assert caught.value.field == "retry.max"


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: RetryPolicy.fixed(-1.0), "retry.delay"),
        (lambda: RetryPolicy.fixed(math.inf), "retry.delay"),
        (lambda: RetryPolicy.fixed(math.nan), "retry.delay"),
        (lambda: RetryPolicy.exponential(base=-1.0, factor=2.0, max=10.0), "retry.base"),
        (lambda: RetryPolicy.exponential(base=1.0, factor=2.0, max=-10.0), "retry.max"),
        (lambda: RetryPolicy.exponential(base=1.0, factor=2.0, max=math.inf), "retry.max"),
    ],
    ids=["fixed-negative", "fixed-inf", "fixed-nan", "exp-negative-base", "exp-negative-max",
         "exp-inf-max"],
)
def test_delays_must_be_finite_and_non_negative(
    build: Callable[[], RetryPolicy], field: str
) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        build()
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: RetryPolicy.fixed(1e300), "retry.delay"),
        (lambda: RetryPolicy.fixed(DURATION_MAX_SECONDS + 1), "retry.delay"),
        (lambda: RetryPolicy.exponential(max=sys.float_info.max), "retry.max"),
        (lambda: RetryPolicy.exponential(base=1e300, max=1e300), "retry.base"),
        (lambda: RetryPolicy.fixed(2**1100), "retry.delay"),
    ],
    ids=["fixed-1e300", "fixed-just-over", "exp-float-max", "exp-huge-base", "int-beyond-float"],
)
def test_delays_and_caps_longer_than_100_years_are_rejected(
    build: Callable[[], RetryPolicy], field: str
) -> None:
    # The worker adds the delay to the database's clock when it records a failure: a longer
    # one would overflow there, long after the policy was written.
    with pytest.raises(InvalidOptionError, match="100 years") as caught:
        build()
    assert caught.value.field == field
    assert RetryPolicy.fixed(DURATION_MAX_SECONDS).ceiling(1) == DURATION_MAX_SECONDS


@pytest.mark.parametrize("jitter", ["no", 0, 1, None])
def test_jitter_must_be_a_bool(jitter: object) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        RetryPolicy.fixed(1.0, jitter=jitter)  # type: ignore[arg-type]
    assert caught.value.field == "retry.jitter"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "never", "base_seconds": 1.0},
        {"kind": "never", "factor": 2.0},
        {"kind": "never", "max_seconds": 2.0},
        {"kind": "fixed"},
        {"kind": "fixed", "base_seconds": 1.0, "factor": 2.0},
        {"kind": "fixed", "base_seconds": 1.0, "max_seconds": 5.0},
        {"kind": "exponential", "base_seconds": 1.0},
        {"kind": "exponential", "base_seconds": 1.0, "factor": 2.0},
        {"kind": "exponential", "factor": 2.0, "max_seconds": 5.0},
        {"kind": "linear", "base_seconds": 1.0},
        {"kind": "fixed", "base_seconds": "5"},
        {"kind": "fixed", "base_seconds": True},
    ],
    ids=lambda kwargs: "-".join(f"{k}={v}" for k, v in kwargs.items()),
)
def test_arguments_that_do_not_fit_the_kind_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidOptionError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_policies_compare_by_value_so_the_worker_can_detect_a_conflict() -> None:
    assert RetryPolicy.exponential(base=1, factor=2, max=60) == RetryPolicy.exponential(
        base=1.0, factor=2.0, max=60.0
    )
    assert RetryPolicy.fixed(1.0) != RetryPolicy.fixed(1.0, jitter=False)
    assert RetryPolicy.fixed(1.0) != RetryPolicy.exponential(base=1.0, factor=1.0, max=1.0)
