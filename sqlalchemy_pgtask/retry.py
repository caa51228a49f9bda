"""retry: retry policies and the delay before the next attempt; pure logic, no I/O.

A policy decides *when* a failed task runs again; ``max_attempts`` (on the task) decides *how
many times*. The delay is computed from the number of failed attempts only, so a workflow that
suspends (sleeps, waits) many times is never pushed into a long backoff or out of retries.

Delays and caps are at most `DURATION_MAX_SECONDS` (100 years): the worker adds them to the
database's clock, where a larger one would overflow when the failure is recorded, long after
the policy was written.

Every policy applies **full jitter** by default: the delay is drawn uniformly from
``[0, ceiling]``, which spreads a burst of failures (a dependency outage) over the whole window
instead of retrying them in lock-step.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypedDict

from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.validation import check_seconds

__all__ = ["PolicyArrays", "PolicyRow", "RetryKind", "RetryPolicy"]

RetryKind = Literal["never", "fixed", "exponential"]


class PolicyRow(Protocol):
    """A row with a stored policy's columns (``tasks`` and ``handler_policies`` both have them)."""

    @property
    def retry_kind(self) -> str | None: ...
    @property
    def retry_base_seconds(self) -> float | None: ...
    @property
    def retry_factor(self) -> float | None: ...
    @property
    def retry_max_seconds(self) -> float | None: ...
    @property
    def retry_jitter(self) -> bool | None: ...


class PolicyArrays(TypedDict):
    """Policies as the parallel arrays the statements bind (one element per policy)."""

    retry_kinds: list[str]
    retry_bases: list[float | None]
    retry_factors: list[float | None]
    retry_maxes: list[float | None]
    retry_jitters: list[bool]


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait before retrying a failed task.

    Build one with `never`, `fixed` or `exponential`. Policies are stored per (queue, task
    name, handler version) and copied onto each task when it is first claimed, so a later deploy
    cannot change how an in-flight task retries.
    """

    kind: RetryKind
    base_seconds: float | None = None
    factor: float | None = None
    max_seconds: float | None = None
    jitter: bool = True

    def __post_init__(self) -> None:
        # Store floats: the policy is bound as float arrays, and mixed int/float lists fail.
        base_name = "retry.delay" if self.kind == "fixed" else "retry.base"
        for name, field_name in ((base_name, "base_seconds"), ("retry.max", "max_seconds")):
            value = getattr(self, field_name)
            if value is not None:
                object.__setattr__(self, field_name, check_seconds(name, value))
        if self.factor is not None:
            if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
                raise InvalidOptionError("retry.factor", "must be a number")
            try:
                factor = float(self.factor)
            except OverflowError:  # an int beyond any float: as refused as an infinite one
                factor = math.inf if self.factor > 0 else -math.inf
            object.__setattr__(self, "factor", factor)
        # Stored in a boolean column and compared for conflicts: 'no' must not mean True.
        if not isinstance(self.jitter, bool):
            raise InvalidOptionError(
                "retry.jitter", f"must be a bool, got {type(self.jitter).__name__}"
            )
        if self.kind == "never":
            if (self.base_seconds, self.factor, self.max_seconds) != (None, None, None):
                raise InvalidOptionError("retry", "a 'never' policy takes no delays")
        elif self.kind == "fixed":
            if self.base_seconds is None or self.factor is not None or self.max_seconds is not None:
                raise InvalidOptionError("retry", "a 'fixed' policy takes only base_seconds")
        elif self.kind == "exponential":
            if self.base_seconds is None or self.factor is None or self.max_seconds is None:
                raise InvalidOptionError(
                    "retry", "an 'exponential' policy needs base_seconds, factor and max_seconds"
                )
            if not (math.isfinite(self.factor) and self.factor >= 1):
                raise InvalidOptionError(
                    "retry.factor", f"must be finite and >= 1, got {self.factor!r}"
                )
            if self.max_seconds < self.base_seconds:
                raise InvalidOptionError("retry.max", "must not be smaller than base")
        else:
            raise InvalidOptionError("retry", f"unknown policy kind {self.kind!r}")

    @classmethod
    def never(cls) -> RetryPolicy:
        """The first failure is final."""
        return cls("never")

    @classmethod
    def fixed(cls, delay: float, *, jitter: bool = True) -> RetryPolicy:
        """Wait ``delay`` seconds (with jitter: up to ``delay``) before each retry."""
        return cls("fixed", base_seconds=delay, jitter=jitter)

    @classmethod
    def exponential(
        cls, *, base: float = 1.0, factor: float = 2.0, max: float = 60.0, jitter: bool = True
    ) -> RetryPolicy:
        """Wait ``base * factor ** (failures - 1)`` seconds, capped at ``max``.

        With jitter (the default) the wait is uniform in ``[0, that ceiling]``.
        """
        return cls("exponential", base_seconds=base, factor=factor, max_seconds=max, jitter=jitter)

    def ceiling(self, failed_attempts: int) -> float | None:
        """The longest wait after ``failed_attempts`` failures (>= 1); None means no retry."""
        if failed_attempts < 1:
            raise ValueError("failed_attempts counts the failure just recorded, so it is >= 1")
        if self.kind == "never":
            return None
        assert self.base_seconds is not None
        if self.kind == "fixed":
            return self.base_seconds
        assert self.factor is not None
        assert self.max_seconds is not None
        if self.base_seconds == 0 or self.factor == 1:
            return min(self.base_seconds, self.max_seconds)
        try:
            ceiling = self.base_seconds * self.factor ** (failed_attempts - 1)
        except OverflowError:  # a huge failure count saturates at the cap
            return self.max_seconds
        return min(ceiling, self.max_seconds)

    @classmethod
    def from_row(cls, row: PolicyRow) -> RetryPolicy | None:
        """The policy stored in ``row``'s ``retry_*`` columns, or None when none is stored."""
        return cls.stored(
            row.retry_kind, row.retry_base_seconds, row.retry_factor, row.retry_max_seconds,
            row.retry_jitter,
        )

    @classmethod
    def stored(
        cls,
        kind: str | None,
        base_seconds: float | None,
        factor: float | None,
        max_seconds: float | None,
        jitter: bool | None,
    ) -> RetryPolicy | None:
        """The policy stored as these ``retry_*`` column values, or None when none is."""
        if kind is None:
            return None
        # The CHECK constraint allows no other kind.
        return _stored_policy(kind, base_seconds, factor, max_seconds, bool(jitter))

    @staticmethod
    def as_arrays(policies: Sequence[RetryPolicy]) -> PolicyArrays:
        """``policies`` as the parallel arrays statements bind, in the same order."""
        return {
            "retry_kinds": [p.kind for p in policies],
            "retry_bases": [p.base_seconds for p in policies],
            "retry_factors": [p.factor for p in policies],
            "retry_maxes": [p.max_seconds for p in policies],
            "retry_jitters": [p.jitter for p in policies],
        }

    def delay(self, failed_attempts: int, rng: random.Random | None = None) -> float | None:
        """Seconds to wait before the next attempt, jitter applied; None means do not retry."""
        ceiling = self.ceiling(failed_attempts)
        if ceiling is None or not self.jitter:
            return ceiling
        return (rng or _RNG).uniform(0.0, ceiling)


# Jitter needs spread, not secrecy.
_RNG = random.Random()  # noqa: S311


@functools.lru_cache(maxsize=256)
def _stored_policy(
    kind: RetryKind,
    base_seconds: float | None,
    factor: float | None,
    max_seconds: float | None,
    jitter: bool,
) -> RetryPolicy:
    # Every task of a handler stores the same policy: one frozen object serves them all,
    # instead of one built and validated per claimed task.
    return RetryPolicy(
        kind, base_seconds=base_seconds, factor=factor, max_seconds=max_seconds, jitter=jitter
    )

