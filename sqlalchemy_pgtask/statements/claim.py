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
    and_,
    any_,
    bindparam,
    case,
    func,
    insert,
    literal_column,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from sqlalchemy_pgtask.retry import PolicyArrays, RetryPolicy
from sqlalchemy_pgtask.statements import _governed
from sqlalchemy_pgtask.statements._common import (
    NOW,
    UUID_T,
    arrays,
    attempts,
    queues,
    rate_buckets,
    seconds,
    tasks,
)
from sqlalchemy_pgtask.states import RUNNING

__all__ = [
    "CLAIM",
    "CLAIMED_COLUMNS",
    "CLAIM_GOVERNED",
    "Capability",
    "CapabilityParams",
    "ClaimParams",
    "capability_params",
    "claim_params",
]


class Capability(NamedTuple):
    """A handler a worker can run: its identity, retry policy, default attempt budget,
    default time limit and concurrency policy (frozen with the retry policy)."""

    queue: str
    name: str
    version: int
    retry: RetryPolicy
    max_attempts: int
    timeout: float | None = None
    concurrency_limit: int | None = None
    concurrency_scope: str = "workflow"


class CapabilityParams(PolicyArrays):
    """A worker's capabilities as parallel arrays, in the worker's queue order."""

    queues: list[str]
    cap_queues: list[str]
    cap_names: list[str]
    cap_versions: list[int]
    cap_max_attempts: list[int]
    cap_timeouts: list[float | None]


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
        "cap_timeouts": [c.timeout for c in served],
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


def pending(table: FromClause = tasks) -> ColumnElement[bool]:
    # A literal so the planner can match the partial claim index in a generic plan.
    return table.c.state == literal_column("'pending'")


def capabilities_cte() -> CTE:
    # "cap", not "capability": the claim names it eleven times, within 4 KiB (see `CLAIM`).
    rows = arrays(
        "cap",
        ("cap_queues", "queue", Text()),
        ("cap_names", "name", Text()),
        ("cap_versions", "version", Integer()),
        ("cap_max_attempts", "max_attempts", Integer()),
        ("cap_timeouts", "timeout", Double()),
        ("retry_kinds", "retry_kind", Text()),
        ("retry_bases", "retry_base_seconds", Double()),
        ("retry_factors", "retry_factor", Double()),
        ("retry_maxes", "retry_max_seconds", Double()),
        ("retry_jitters", "retry_jitter", Boolean()),
    )
    return select(rows).cte("capabilities")


def served_cte(*, governed: bool) -> CTE:
    """The worker's queues in its order, without the paused ones.

    ``governed``: with their starvation timeout and rate limit (NULL: none). Otherwise without
    the queues that have either: the plain claim never serves them, so a limit set at any
    moment holds at once.
    """
    order = (
        func.unnest(bindparam("queues", type_=ARRAY(Text)))
        .table_valued("name", with_ordinality="ord")
        .render_derived("served")
    )
    if governed:
        return (
            select(
                order.c.name, order.c.ord, queues.c.starvation_timeout_seconds.label("starve"),
                queues.c.rate_limit, queues.c.rate_period_seconds.label("rate_period"),
            )
            .select_from(order.outerjoin(queues, queues.c.name == order.c.name))
            .where(queues.c.paused_at.is_(None))
            .cte("served")
        )
    q = alias(queues, "q")
    held_back = (
        select(q.c.name)
        .where(
            q.c.name == order.c.name,
            or_(
                q.c.paused_at.is_not(None), q.c.rate_limit.is_not(None),
                q.c.starvation_timeout_seconds.is_not(None),
            ),
        )
        .exists()
    )
    return select(order.c.name, order.c.ord).where(~held_back).cte("served")


def capable(capabilities: CTE, table: FromClause = tasks) -> ColumnElement[bool]:
    return tuple_(table.c.name, table.c.version).in_(
        select(capabilities.c.name, capabilities.c.version).where(
            capabilities.c.queue == table.c.queue
        )
    )


def admitted(table: FromClause = tasks) -> ColumnElement[bool]:
    """A task without a concurrency key, or one whose key it may take now: the claim passes
    over the tasks of a full key (and those behind the next in line), so one key's backlog
    never holds back another key's tasks. ``tasks_concurrency_grant`` checks again, under the
    key's lock, as the row turns running (revision pgtask_0016)."""
    return or_(
        table.c.concurrency_key.is_(None),
        func.pgtask.concurrency_admits(table.c.id, type_=Boolean),
    )


CLAIMED_COLUMNS: Final = (
    "id", "queue", "name", "version", "payload", "headers", "priority", "attempt",
    "failed_attempts", "max_attempts", "lease_token", "cancel_requested_at", "retry_kind",
    "retry_base_seconds", "retry_factor", "retry_max_seconds", "retry_jitter",
)


def _startable(capabilities: CTE, table: FromClause) -> ColumnElement[bool]:
    return and_(capable(capabilities, table), admitted(table))


def _plain_candidates(capabilities: CTE, served: CTE, limit: ColumnElement[Any]) -> FromClause:
    c = _CANDIDATE
    return (
        select(c.c.id, c.c.priority, c.c.run_at)
        .where(
            pending(c),
            c.c.queue == served.c.name,
            c.c.run_at <= NOW,
            capable(capabilities, c),
            admitted(c),
        )
        .order_by(c.c.priority.desc(), c.c.run_at, c.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True, key_share=True)  # FOR NO KEY UPDATE SKIP LOCKED
        .lateral("candidate")
    )


def _claim(*, governed: bool) -> Select[Any]:
    capabilities = capabilities_cte()
    served = served_cte(governed=governed)
    t = _CLAIMED
    limit = bindparam("limit", type_=Integer)
    if governed:
        locked = _governed.buckets(served)
        queue_order: CTE = _governed.allowance(served, locked, limit)
        candidate = _governed.candidates(capabilities, queue_order, pending, _startable)
        order: tuple[Any, ...] = (candidate.c.rank, candidate.c.prio.desc())
    else:
        queue_order = served
        candidate = _plain_candidates(capabilities, served, limit)
        order = (candidate.c.priority.desc(),)
    picked = (
        select(candidate.c.id)
        .select_from(queue_order.join(candidate, true()))
        .order_by(
            queue_order.c.ord, *order, candidate.c.run_at, candidate.c.id,
        )
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
    time_limit = func.coalesce(t.c.timeout_seconds, capabilities.c.timeout)
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
        .returning(
            *(t.c[name] for name in CLAIMED_COLUMNS),
            time_limit.label("time_limit"),
            (NOW + seconds(time_limit)).label("deadline_at"),
        )
        .cte("claimed")
    )
    recorded = insert(attempts).from_select(
        ["task_id", "attempt", "lease_token", "worker_id", "started_at", "deadline_at"],
        select(
            claimed.c.id, claimed.c.attempt, claimed.c.lease_token, worker_id, NOW,
            claimed.c.deadline_at,
        ),
    ).cte("recorded")
    returned = {name: claimed.c[name] for name in CLAIMED_COLUMNS}
    # Most tasks have no headers: NULL spares the worker parsing '{}' for each of them.
    returned["headers"] = func.nullif(
        claimed.c.headers, literal_column("'{}'::jsonb")
    ).label("headers")
    result = (
        select(
            *returned.values(),
            claimed.c.time_limit,
            claimed.c.deadline_at,
        )
        .add_cte(recorded)
        .order_by(claimed.c.priority.desc(), claimed.c.id)
    )
    if not governed:
        return result
    spent = (
        select(claimed.c.queue, func.count().label("n")).group_by(claimed.c.queue).cte("spent")
    )
    spend = (
        update(rate_buckets)
        .where(rate_buckets.c.queue == locked.c.queue, spent.c.queue == locked.c.queue)
        # A claim that waited for the bucket may have started before the one that refilled it
        # last: its time must not move the refill clock back (and credit tokens twice).
        .values(
            tokens=locked.c.available - spent.c.n,
            refilled_at=func.greatest(locked.c.refilled_at, NOW),
        )
        .cte("spend")
    )
    # A limit set since the last claim: its bucket starts full, from the next claim on.
    fill = (
        pg_insert(rate_buckets)
        .from_select(
            ["queue", "tokens", "refilled_at"],
            select(served.c.name, served.c.rate_limit, NOW)
            .where(
                served.c.rate_limit.is_not(None),
                ~select(locked.c.queue).where(locked.c.queue == served.c.name).exists(),
            )
            .order_by(served.c.name),
        )
        .on_conflict_do_nothing(index_elements=[rate_buckets.c.queue])
        .cte("fill")
    )
    return result.add_cte(spend, fill)


#: Claims up to ``limit`` due pending tasks across the worker's ``queues`` in one statement:
#: earlier queues first, then highest priority, then oldest ``run_at``; only (queue, name,
#: version) among the worker's capabilities; nothing from a paused queue, nor from a governed
#: one (a rate limit or starvation timeout: `CLAIM_GOVERNED` serves those). Each queue is read
#: through ``ix_tasks_claim`` (a LATERAL probe), and the picked rows are locked ``FOR NO KEY
#: UPDATE SKIP LOCKED`` so concurrent claimers skip each other's rows. Sets running, attempt +
#: 1, a fresh lease token and an expiry of database time + ``lease_seconds``; snapshots the
#: retry policy and fills a missing ``max_attempts`` from the capability on first claim;
#: inserts one ``attempts`` row each, with the attempt's deadline (database time + the task's,
#: or else the handler's, time limit). Returns `CLAIMED_COLUMNS` of the claimed tasks (with
#: ``headers`` NULL where they are empty), then ``time_limit`` (seconds or NULL) and
#: ``deadline_at``. Kept under psycopg's 4 KiB limit for cached parsing (33 bytes to spare
#: on 2026-12-08, with the concurrency filter): the governed form is longer, and paid for
#: only by workers that need it. A task with a concurrency key is claimed only when
#: ``pgtask.concurrency_admits`` lets it take its key (see `admitted`).
CLAIM: Final = _claim(governed=False)

#: `CLAIM` for a worker some of whose queues are governed, serving all its unpaused queues:
#: within a queue, tasks due for longer than its starvation timeout come first (oldest first,
#: through ``ix_tasks_pending_run_at``), then the others by priority; from a rate-limited queue
#: no more than the whole tokens its bucket holds, which the claim spends. Buckets are locked
#: ``FOR UPDATE`` (a concurrent claimer of the same queue waits, then reads what the first
#: one left), so every worker shares one limit, and a limited queue takes nothing from the
#: other queues' share of the batch. A queue whose limit is new gets a full bucket, from its
#: next claim on. Same binds and rows as `CLAIM`.
CLAIM_GOVERNED: Final = _claim(governed=True)


