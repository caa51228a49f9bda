"""statements._governed: the parts of the governed claim (rate limits, starvation); no I/O."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    Double,
    FromClause,
    Integer,
    alias,
    case,
    cast,
    false,
    func,
    literal_column,
    select,
    union_all,
)

from sqlalchemy_pgtask.statements._common import NOW, rate_buckets, seconds, tasks

__all__ = ["allowance", "buckets", "candidates"]


def buckets(served: CTE) -> CTE:
    """The token buckets of the served rate-limited queues, locked, with the tokens they hold
    now (refilled for the time since their last claim, capped at the limit).

    ``FOR UPDATE`` waits for a concurrent claimer of the same queue and then reads the row it
    committed: two claims never spend the same tokens.
    """
    b = rate_buckets
    elapsed = func.greatest(0.0, func.extract("epoch", NOW - b.c.refilled_at))
    refill = elapsed * served.c.rate_limit / served.c.rate_period
    return (
        select(
            b.c.queue,
            func.least(
                cast(served.c.rate_limit, Double), b.c.tokens + refill
            ).label("available"),
            b.c.refilled_at,
        )
        .select_from(b.join(served, served.c.name == b.c.queue))
        .where(served.c.rate_limit.is_not(None))
        # In name order, whatever the worker's queue order: two claimers of the same queues
        # never lock their buckets in opposite orders (a deadlock).
        .order_by(b.c.queue)
        .with_for_update(of=b)
        .cte("buckets")
    )


def allowance(served: CTE, buckets: CTE, limit: ColumnElement[Any]) -> CTE:
    """The served queues with how many tasks each may start now (``quota``): ``limit``, or
    fewer for a rate-limited queue (its whole tokens; none until its bucket exists)."""
    tokens = cast(func.floor(buckets.c.available), Integer)
    quota = case(
        (served.c.rate_limit.is_(None), limit),
        else_=func.least(limit, func.coalesce(tokens, 0)),
    )
    return (
        select(served.c.name, served.c.ord, served.c.starve, quota.label("quota"))
        .select_from(served.outerjoin(buckets, buckets.c.queue == served.c.name))
        .cte("allowance")
    )


def candidates(
    capabilities: CTE,
    served: CTE,
    pending: Callable[[FromClause], ColumnElement[bool]],
    capable: Callable[[CTE, FromClause], ColumnElement[bool]],
) -> FromClause:
    """A served queue's candidates, locked: starved tasks (due for longer than the queue's
    starvation timeout) oldest first, then the others by priority."""
    starved_cutoff = NOW - seconds(served.c.starve)
    queue_limit = served.c.quota
    s = alias(tasks, "s")
    starved = (
        select(s.c.id, literal_column("0").label("rank"), literal_column("0").label("prio"),
               s.c.run_at)
        .where(
            pending(s), s.c.queue == served.c.name, s.c.run_at <= starved_cutoff,
            capable(capabilities, s),
        )
        .order_by(s.c.run_at, s.c.id)
        .limit(queue_limit)
        .with_for_update(skip_locked=True, key_share=True)  # FOR NO KEY UPDATE SKIP LOCKED
        .correlate(served)
        .subquery("starved")
    )
    c = alias(tasks, "c")
    by_priority = (
        select(c.c.id, literal_column("1").label("rank"), c.c.priority.label("prio"),
               c.c.run_at)
        .where(
            pending(c), c.c.queue == served.c.name, c.c.run_at <= NOW,
            capable(capabilities, c),
            # Taken by the first branch when starved; NULL (no timeout) counts as not.
            ~func.coalesce(c.c.run_at <= starved_cutoff, false()),
        )
        .order_by(c.c.priority.desc(), c.c.run_at, c.c.id)
        .limit(queue_limit)
        .with_for_update(skip_locked=True, key_share=True)
        .correlate(served)
        .subquery("by_priority")
    )
    both = union_all(select(starved), select(by_priority)).subquery("both")
    return (
        select(both)
        .order_by(both.c.rank, both.c.prio.desc(), both.c.run_at, both.c.id)
        .limit(queue_limit)
        .correlate(served)
        .lateral("candidate")
    )
