"""statements.due: when an idle worker should look again, and which of its queues are
governed; no I/O."""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Select,
    Text,
    any_,
    bindparam,
    func,
    or_,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY

from sqlalchemy_pgtask.statements._common import NOW, queues, rate_buckets, seconds, tasks
from sqlalchemy_pgtask.statements.claim import capabilities_cte, capable, pending, served_cte

__all__ = ["GOVERNED_QUEUES", "SECONDS_UNTIL_DUE", "SECONDS_UNTIL_DUE_GOVERNED"]


def _seconds_until_due(*, governed: bool) -> Select[Any]:
    capabilities = capabilities_cte()
    served = served_cte(governed=governed)
    earliest = (
        select(tasks.c.run_at)
        .where(pending(), tasks.c.queue == served.c.name, capable(capabilities))
        .order_by(tasks.c.run_at)
        .limit(1)
        .lateral("earliest")
    )
    startable: ColumnElement[Any] = earliest.c.run_at
    if governed:
        b = rate_buckets
        # A rate-limited queue without a whole token starts nothing before it refills one.
        next_token = (
            select(b.c.refilled_at + seconds((1 - b.c.tokens) * served.c.rate_period
                                             / served.c.rate_limit))
            .where(b.c.queue == served.c.name, b.c.tokens < 1)
            .scalar_subquery()
        )
        startable = func.greatest(earliest.c.run_at, next_token)
    upcoming = select(func.min(startable)).select_from(served.join(earliest, true()))
    return select(func.extract("epoch", upcoming.scalar_subquery() - NOW))


#: Seconds (database time) until the earliest pending task `CLAIM` could claim falls due:
#: zero or less when one is due already (a claim that raced with it, or a row another
#: transaction held locked), NULL when there is none, so an idle worker sleeps until its poll
#: interval instead of spinning. One ``ORDER BY run_at LIMIT 1`` probe of
#: ``ix_tasks_pending_run_at`` per served, unpaused queue. Locks nothing. Binds the
#: `CapabilityParams`.
SECONDS_UNTIL_DUE: Final = _seconds_until_due(governed=False)

#: `SECONDS_UNTIL_DUE` for `CLAIM_GOVERNED`: a rate-limited queue's task is due no sooner than
#: its bucket holds a whole token again.
SECONDS_UNTIL_DUE_GOVERNED: Final = _seconds_until_due(governed=True)

#: The worker's queues (bind ``queues``) that are governed: a rate limit or a starvation
#: timeout. Reads ``pgtask.queues`` by primary key; locks nothing.
GOVERNED_QUEUES: Final = select(queues.c.name).where(
    queues.c.name == any_(bindparam("queues", type_=ARRAY(Text))),
    or_(queues.c.rate_limit.is_not(None), queues.c.starvation_timeout_seconds.is_not(None)),
)


