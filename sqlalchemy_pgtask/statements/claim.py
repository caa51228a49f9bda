"""statements.claim: the claim and the idle worker's "when is the next task due", with the
capabilities they bind; no I/O.

A worker's capabilities are the (queue, name, version) handlers it registered, with their retry
policies and attempt budgets, bound as parallel arrays in the worker's queue order.
"""

from __future__ import annotations

import typing
import uuid
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from sqlalchemy import (
    CTE,
    Alias,
    Boolean,
    ColumnElement,
    Double,
    FromClause,
    Integer,
    Select,
    Text,
    alias,
    any_,
    bindparam,
    case,
    func,
    insert,
    literal_column,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from sqlalchemy_pgtask.retry import PolicyArrays, RetryPolicy
from sqlalchemy_pgtask.statements._common import (
    NOW,
    UUID_T,
    arrays,
    attempts,
    queues,
    seconds,
    tasks,
)
from sqlalchemy_pgtask.states import RUNNING

__all__ = [
    "CLAIM",
    "CLAIMED_COLUMNS",
    "SECONDS_UNTIL_DUE",
    "Capability",
    "CapabilityParams",
    "ClaimParams",
    "capability_params",
    "claim_params",
]


class Capability(NamedTuple):
    """A handler a worker can run: its identity, retry policy and default attempt budget."""

    queue: str
    name: str
    version: int
    retry: RetryPolicy
    max_attempts: int


class CapabilityParams(PolicyArrays):
    """A worker's capabilities as parallel arrays, in the worker's queue order."""

    queues: list[str]
    cap_queues: list[str]
    cap_names: list[str]
    cap_versions: list[int]
    cap_max_attempts: list[int]


class ClaimParams(CapabilityParams):
    worker_id: uuid.UUID
    lease_seconds: float
    limit: int


def capability_params(queue_order: Sequence[str], served: Sequence[Capability]) -> CapabilityParams:
    """``served`` as the arrays `CLAIM` and `SECONDS_UNTIL_DUE` bind; ``queue_order`` first."""
    return {
        "queues": list(queue_order),
        "cap_queues": [c.queue for c in served],
        "cap_names": [c.name for c in served],
        "cap_versions": [c.version for c in served],
        "cap_max_attempts": [c.max_attempts for c in served],
        **RetryPolicy.as_arrays([c.retry for c in served]),
    }


def claim_params(
    capabilities: CapabilityParams, *, worker_id: uuid.UUID, lease_seconds: float, limit: int
) -> ClaimParams:
    return {
        **capabilities,
        "worker_id": worker_id,
        "lease_seconds": float(lease_seconds),
        "limit": limit,
    }


# -- claim ---------------------------------------------------------------------------------


#: Short aliases keep the claim's text under psycopg's 4 KiB cache limit for parsed queries
#: (longer ones are parsed again on every execution).
_CANDIDATE: Final = alias(tasks, "c")
_CLAIMED: Final = typing.cast("Alias[Any]", alias(tasks, "t"))


def _pending(table: FromClause = tasks) -> ColumnElement[bool]:
    # A literal so the planner can match the partial claim index in a generic plan.
    return table.c.state == literal_column("'pending'")


def _capabilities() -> CTE:
    rows = arrays(
        "capability",
        ("cap_queues", "queue", Text()),
        ("cap_names", "name", Text()),
        ("cap_versions", "version", Integer()),
        ("cap_max_attempts", "max_attempts", Integer()),
        ("retry_kinds", "retry_kind", Text()),
        ("retry_bases", "retry_base_seconds", Double()),
        ("retry_factors", "retry_factor", Double()),
        ("retry_maxes", "retry_max_seconds", Double()),
        ("retry_jitters", "retry_jitter", Boolean()),
    )
    return select(rows).cte("capabilities")


def _served() -> CTE:
    """The worker's queues in its order, without the paused ones."""
    order = (
        func.unnest(bindparam("queues", type_=ARRAY(Text)))
        .table_valued("name", with_ordinality="ord")
        .render_derived("served")
    )
    paused = (
        select(queues.c.name)
        .where(queues.c.name == order.c.name, queues.c.paused_at.is_not(None))
        .exists()
    )
    return select(order.c.name, order.c.ord).where(~paused).cte("served")


def _capable(capabilities: CTE, table: FromClause = tasks) -> ColumnElement[bool]:
    return tuple_(table.c.name, table.c.version).in_(
        select(capabilities.c.name, capabilities.c.version).where(
            capabilities.c.queue == table.c.queue
        )
    )


CLAIMED_COLUMNS: Final = (
    "id", "queue", "name", "version", "payload", "headers", "priority", "attempt",
    "failed_attempts", "max_attempts", "lease_token", "cancel_requested_at", "retry_kind",
    "retry_base_seconds", "retry_factor", "retry_max_seconds", "retry_jitter",
)


def _claim() -> Select[Any]:
    capabilities = _capabilities()
    served = _served()
    c, t = _CANDIDATE, _CLAIMED
    limit = bindparam("limit", type_=Integer)
    per_queue = (
        select(c.c.id, c.c.priority, c.c.run_at)
        .where(
            _pending(c),
            c.c.queue == served.c.name,
            c.c.run_at <= NOW,
            _capable(capabilities, c),
        )
        .order_by(c.c.priority.desc(), c.c.run_at, c.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True, key_share=True)  # FOR NO KEY UPDATE SKIP LOCKED
        .lateral("candidate")
    )
    picked = (
        select(per_queue.c.id)
        .select_from(served.join(per_queue, true()))
        .order_by(served.c.ord, per_queue.c.priority.desc(), per_queue.c.run_at, per_queue.c.id)
        .limit(limit)
        .cte("picked")
    )
    unset = t.c.retry_kind.is_(None)
    snapshot: dict[str, ColumnElement[Any]] = {
        name: case((unset, capabilities.c[name]), else_=t.c[name])
        for name in (
            "retry_kind", "retry_base_seconds", "retry_factor", "retry_max_seconds",
            "retry_jitter",
        )
    }
    snapshot["max_attempts"] = func.coalesce(t.c.max_attempts, capabilities.c.max_attempts)
    worker_id = bindparam("worker_id", type_=UUID_T)
    claimed = (
        update(t)
        .where(
            # ANY(ARRAY(subquery)) always probes the primary key; a join to the CTE may get a
            # generic plan that ignores the LIMIT and scans the whole table.
            t.c.id == any_(func.array(select(picked.c.id).scalar_subquery())),
            capabilities.c.queue == t.c.queue,
            capabilities.c.name == t.c.name,
            capabilities.c.version == t.c.version,
        )
        .values(
            state=RUNNING,
            attempt=t.c.attempt + 1,
            lease_token=func.gen_random_uuid(),
            lease_owner=worker_id,
            lease_expires_at=NOW + seconds(bindparam("lease_seconds", type_=Double)),
            updated_at=NOW,
            **snapshot,
        )
        .returning(*(t.c[name] for name in CLAIMED_COLUMNS))
        .cte("claimed")
    )
    recorded = insert(attempts).from_select(
        ["task_id", "attempt", "lease_token", "worker_id", "started_at"],
        select(claimed.c.id, claimed.c.attempt, claimed.c.lease_token, worker_id, NOW),
    ).cte("recorded")
    return (
        select(*(claimed.c[name] for name in CLAIMED_COLUMNS))
        .add_cte(recorded)
        .order_by(claimed.c.priority.desc(), claimed.c.id)
    )


#: Claims up to ``limit`` due pending tasks across the worker's ``queues`` in one statement:
#: earlier queues first, then highest priority, then oldest ``run_at``; only (queue, name,
#: version) among the worker's capabilities; nothing from a paused queue. Each queue is read
#: through ``ix_tasks_claim`` (a LATERAL probe), and the picked rows are locked ``FOR NO KEY
#: UPDATE SKIP LOCKED`` so concurrent claimers skip each other's rows. Sets running, attempt +
#: 1, a fresh lease token and an expiry of database time + ``lease_seconds``; snapshots the
#: retry policy and fills a missing ``max_attempts`` from the capability on first claim;
#: inserts one ``attempts`` row each. Returns `CLAIMED_COLUMNS` of the claimed tasks.
CLAIM: Final = _claim()


def _seconds_until_due() -> Select[Any]:
    capabilities = _capabilities()
    served = _served()
    earliest = (
        select(tasks.c.run_at)
        .where(_pending(), tasks.c.queue == served.c.name, _capable(capabilities))
        .order_by(tasks.c.run_at)
        .limit(1)
        .lateral("earliest")
    )
    upcoming = select(func.min(earliest.c.run_at)).select_from(served.join(earliest, true()))
    return select(func.extract("epoch", upcoming.scalar_subquery() - NOW))


#: Seconds (database time) until the earliest pending task the worker could claim falls due:
#: zero or less when one is due already (a claim that raced with it, or a row another
#: transaction held locked), NULL when there is none, so an idle worker sleeps until its poll
#: interval instead of spinning. One ``ORDER BY run_at LIMIT 1`` probe of
#: ``ix_tasks_pending_run_at`` per served, unpaused queue. Locks nothing. Binds the
#: `CapabilityParams`.
SECONDS_UNTIL_DUE: Final = _seconds_until_due()


