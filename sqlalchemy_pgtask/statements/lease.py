"""statements.lease: renewals, outcomes and recovery, and their parameter contracts; no I/O.

Every statement a running attempt causes is fenced by (id, state, attempt, lease token), and
takes its rows with ``FOR NO KEY UPDATE SKIP LOCKED``: a row that somebody else holds locked
(``cancel()`` inside a long business transaction, say) is skipped and reported as not written,
never waited for. The caller tells a skipped row from a lost lease by reading `LEASES`. What
the triggers of an outcome touch beyond the task rows is another matter: a finished task
cancels its unfinished descendants (waiting for their rows, up to ``lock_timeout``), and a
finished child wakes its waiting parent (failing at once, SQLSTATE 55P03, if another
transaction holds the parent). The worker then writes its outcomes one at a time.

The fence state is not a literal ``'running'``: that would match the partial lease index, and
the plan would then walk every running row (and every dead entry not yet vacuumed) for each row
of the batch. It is a bound value (default ``'running'``, so callers never pass it) read through
a scalar subquery, which not even a custom plan can match to the index predicate.

Each statement comes with a builder of its parameters; the worker binds nothing else, and the
contract test compares the builders with the statements' bind names.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Final, TypedDict

from sqlalchemy import (
    CTE,
    ColumnElement,
    Double,
    Integer,
    Select,
    TableValuedAlias,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.sql.dml import ReturningUpdate

from sqlalchemy_pgtask.statements._common import (
    CANCELLED_ERROR,
    NOW,
    UUID_T,
    Lease,
    arrays,
    attempts,
    not_aside,
    running_state,
    seconds,
    tasks,
)

__all__ = [
    "COMPLETE", "FAIL", "LEASES", "OWNED", "RECOVER", "RELEASE", "RENEW", "CompleteParams",
    "FailParams", "FenceParams", "ReleaseParams", "RenewParams", "complete_params",
    "expired_leases", "fail_params", "fence_params", "recover_from", "release_params",
    "renew_params",
]

_EXPIRED_ERROR: Final = cast(literal_column("""'{"type": "lease_expired"}'"""), JSONB)


# -- parameter contracts -------------------------------------------------------------------


class FenceParams(TypedDict):
    """A batch of leases: the fence of every write a running attempt makes."""

    ids: list[uuid.UUID]
    attempts: list[int]
    tokens: list[uuid.UUID]


class RenewParams(FenceParams):
    lease_seconds: float


class CompleteParams(FenceParams):
    results: list[str]


class ReleaseParams(FenceParams):
    delays: list[float]


class FailParams(FenceParams):
    errors: list[str]
    delays: list[float | None]


def fence_params(leases: Sequence[Lease]) -> FenceParams:
    return {
        "ids": [lease.task_id for lease in leases],
        "attempts": [lease.attempt for lease in leases],
        "tokens": [lease.token for lease in leases],
    }


def renew_params(leases: Sequence[Lease], lease_seconds: float) -> RenewParams:
    return {**fence_params(leases), "lease_seconds": float(lease_seconds)}


def complete_params(leases: Sequence[Lease], results: Sequence[str]) -> CompleteParams:
    return {**fence_params(leases), "results": list(results)}


def release_params(leases: Sequence[Lease], delays: Sequence[float] | None = None) -> ReleaseParams:
    """Release ``leases``, each pending again after its delay (default: at once)."""
    return {
        **fence_params(leases),
        "delays": [0.0] * len(leases) if delays is None else [float(d) for d in delays],
    }


def fail_params(
    leases: Sequence[Lease], errors: Sequence[str], delays: Sequence[float | None]
) -> FailParams:
    # One element type for the whole array: a mix of int and float fails to bind.
    return {
        **fence_params(leases),
        "errors": list(errors),
        "delays": [None if d is None else float(d) for d in delays],
    }


# -- fenced transitions --------------------------------------------------------------------


def _requests(*extra: tuple[str, str, Any]) -> TableValuedAlias:
    return arrays(
        "request",
        ("ids", "id", UUID_T),
        ("attempts", "attempt", Integer()),
        ("tokens", "token", UUID_T),
        *extra,
    )


def _ids() -> ColumnElement[Any]:
    return bindparam("ids", type_=ARRAY(UUID_T))


def _held(request: TableValuedAlias) -> CTE:
    """The requested rows whose lease still holds, locked; rows locked by others are skipped."""
    return (
        select(tasks.c.id)
        .select_from(tasks.join(request, tasks.c.id == request.c.id))
        .where(
            tasks.c.id == any_(_ids()),
            tasks.c.state == running_state(),
            tasks.c.attempt == request.c.attempt,
            tasks.c.lease_token == request.c.token,
        )
        .with_for_update(skip_locked=True, key_share=True, of=tasks)
        .cte("held")
    )


def _in_held(held: CTE, request: TableValuedAlias) -> list[ColumnElement[bool]]:
    # Each held row joined to its own request: a batch may hold a stale attempt's outcome (set
    # aside while the row was locked) beside the next one's; by id alone either could win.
    return [
        tasks.c.id == any_(func.array(select(held.c.id).scalar_subquery())),
        tasks.c.id == request.c.id,
        tasks.c.attempt == request.c.attempt,
        tasks.c.lease_token == request.c.token,
    ]


def _renew() -> ReturningUpdate[Any]:
    request = _requests()
    return (
        update(tasks)
        .where(*_in_held(_held(request), request))
        .values(lease_expires_at=NOW + seconds(bindparam("lease_seconds", type_=Double)))
        .returning(tasks.c.id, tasks.c.cancel_requested_at.is_not(None).label("cancel"))
    )


#: Extends the leases of many attempts by ``lease_seconds`` of database time. Fenced; locks the
#: matching rows through the primary key and skips rows others hold locked. Returns ``(id,
#: cancel)`` for each lease extended (``cancel``: someone requested cancellation); a missing id
#: lost its lease, or was skipped (`LEASES` tells which). Binds `RenewParams`.
RENEW: Final = _renew()


def _finish(
    request: TableValuedAlias,
    state: ColumnElement[Any],
    values: dict[str, Any],
    *,
    release: bool = False,
) -> Select[Any]:
    """A fenced transition out of running, recorded on the task and on its attempt row.

    A task back to pending records its attempt as failed, or, for a ``release``, as released
    with no error (the task keeps the error of an earlier failure; the release is not one).
    """
    done = (
        update(tasks)
        .where(*_in_held(_held(request), request))
        .values(
            state=state,
            lease_token=None,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=NOW,
            **values,
        )
        .returning(tasks.c.id, tasks.c.attempt, tasks.c.state, tasks.c.error)
        .cte("done")
    )
    back = done.c.state == literal_column("'pending'")
    attempt_state = case(
        (back, literal_column("'released'" if release else "'failed'")), else_=done.c.state
    )
    attempt_error = case((back, null()), else_=done.c.error) if release else done.c.error
    recorded = (
        update(attempts)
        .where(
            # Redundant with the join, but lets even a generic plan probe the primary key.
            attempts.c.task_id == any_(_ids()),
            attempts.c.task_id == done.c.id,
            attempts.c.attempt == done.c.attempt,
        )
        .values(state=attempt_state, finished_at=NOW, error=attempt_error)
        .cte("recorded")
    )
    return select(done.c.id, done.c.state).add_cte(recorded)


def _complete() -> Select[Any]:
    request = _requests(("results", "result", Text()))
    go_on = tasks.c.cancel_requested_at.is_(None)
    return _finish(
        request,
        case((go_on, literal_column("'succeeded'")), else_=literal_column("'cancelled'")),
        {
            "result": case((go_on, cast(request.c.result, JSONB)), else_=null()),
            "error": case((go_on, null()), else_=CANCELLED_ERROR),
            "completed_at": NOW,
        },
    )


#: Marks many attempts succeeded with their JSON results. Fenced; locks the matching task rows
#: (skipping rows others hold) and their attempt rows through primary keys. A task whose
#: cancellation was requested ends cancelled instead: a success that arrives after a cancel
#: request is not recorded. Returns ``(id, state)`` for each write made; a missing id lost its
#: lease or was skipped. Binds `CompleteParams`.
COMPLETE: Final = _complete()


def _fail() -> Select[Any]:
    request = _requests(("errors", "error", Text()), ("delays", "delay", Double()))
    cancel = tasks.c.cancel_requested_at.is_not(None)
    retry = and_(
        request.c.delay.is_not(None), tasks.c.failed_attempts + 1 < tasks.c.max_attempts
    )
    state = case(
        (cancel, literal_column("'cancelled'")),
        (retry, literal_column("'pending'")),
        else_=literal_column("'failed'"),
    )
    return _finish(
        request,
        state,
        {
            "failed_attempts": tasks.c.failed_attempts + case((cancel, 0), else_=1),
            "error": case((cancel, CANCELLED_ERROR), else_=cast(request.c.error, JSONB)),
            "result": null(),
            "run_at": case(
                (and_(~cancel, retry), NOW + seconds(request.c.delay)), else_=tasks.c.run_at
            ),
            "completed_at": case((and_(~cancel, retry), null()), else_=NOW),
        },
    )


#: Records failed attempts. Each gets its structured error; with a ``delay`` (seconds) and
#: attempts left it goes back to pending at database time + delay, otherwise it fails for good
#: (``delay`` NULL means do not retry). A cancel request wins over both. Fenced like
#: `COMPLETE`. Returns ``(id, state)`` per write made. Binds `FailParams`.
FAIL: Final = _fail()


def _release() -> Select[Any]:
    request = _requests(("delays", "delay", Double()))
    cancel = tasks.c.cancel_requested_at.is_not(None)
    return _finish(
        request,
        case((cancel, literal_column("'cancelled'")), else_=literal_column("'pending'")),
        {
            "run_at": NOW + seconds(request.c.delay),
            "error": case((cancel, CANCELLED_ERROR), else_=tasks.c.error),
            "completed_at": case((cancel, NOW), else_=null()),
        },
        release=True,
    )


#: Hands attempts back (shutdown, a lease about to expire, a claim whose outcome was unknown):
#: pending again after ``delay`` seconds (0: at once), and the attempt is recorded as
#: ``released`` without counting as a failure. Fenced like `COMPLETE`. Returns ``(id, state)``
#: per release. Binds `ReleaseParams`.
RELEASE: Final = _release()


# -- recovery and reads --------------------------------------------------------------------


def recover_from(expired: CTE, error: ColumnElement[Any] = _EXPIRED_ERROR) -> Select[Any]:
    """Takes back the running tasks ``expired`` selects (and locks): pending while attempts
    remain (the lost attempt counts as failed), failed otherwise, cancelled if requested;
    their attempts are recorded as ``lost`` with ``error``."""
    cancel = tasks.c.cancel_requested_at.is_not(None)
    retry = tasks.c.failed_attempts + 1 < tasks.c.max_attempts
    state = case(
        (cancel, literal_column("'cancelled'")),
        (retry, literal_column("'pending'")),
        else_=literal_column("'failed'"),
    )
    done = (
        update(tasks)
        .where(tasks.c.id == any_(func.array(select(expired.c.id).scalar_subquery())))
        .values(
            state=state,
            failed_attempts=tasks.c.failed_attempts + case((cancel, 0), else_=1),
            error=case((cancel, CANCELLED_ERROR), else_=error),
            run_at=NOW,
            completed_at=case((and_(~cancel, retry), null()), else_=NOW),
            lease_token=None,
            lease_owner=None,
            lease_expires_at=None,
            updated_at=NOW,
        )
        .returning(tasks.c.id, tasks.c.attempt, tasks.c.state)
        .cte("done")
    )
    recorded = (
        update(attempts)
        .where(
            attempts.c.task_id == any_(func.array(select(done.c.id).scalar_subquery())),
            attempts.c.task_id == done.c.id,
            attempts.c.attempt == done.c.attempt,
        )
        .values(state="lost", finished_at=NOW, error=error)
        .cte("recorded")
    )
    return select(done.c.id, done.c.state).add_cte(recorded)


def expired_leases(*, one: bool) -> Select[Any]:
    """The ids of the running tasks whose lease expired, earliest expiry first: up to
    ``limit`` of them but those in ``aside``, or (``one``) the task ``task`` if it is one."""
    chosen = tasks.c.id == bindparam("task", type_=UUID_T) if one else not_aside(tasks.c.id)
    return (
        select(tasks.c.id)
        .where(tasks.c.state == literal_column("'running'"), tasks.c.lease_expires_at <= NOW,
               chosen)
        .order_by(tasks.c.lease_expires_at, tasks.c.id)
        .limit(1 if one else bindparam("limit", type_=Integer))
    )


#: Recovers up to ``limit`` running tasks whose lease expired (their worker died or stalled),
#: except those in ``aside`` (default none): pending again at once while attempts remain (the
#: lost attempt counts as failed), failed otherwise, cancelled if cancellation was requested.
#: Locks the expired rows with ``SKIP LOCKED`` so recoverers never wait on each other; served
#: by ``ix_tasks_lease_expiry``. Returns ``(id, state)`` per recovered task.
RECOVER: Final = recover_from(
    expired_leases(one=False).with_for_update(skip_locked=True, key_share=True).cte("expired")
)

#: The authoritative lease state of some tasks, read when a write's outcome is unknown (the
#: connection broke around its commit) or a fenced write skipped a locked row. Locks nothing.
#: Binds ``ids``.
LEASES: Final = select(tasks.c.id, tasks.c.state, tasks.c.attempt, tasks.c.lease_token).where(
    tasks.c.id == any_(_ids())
)

#: The leases a worker holds, ``(id, attempt, lease_token)``: after a claim whose outcome was
#: unknown, the ones it does not know about were claimed and must be handed back. Reads the
#: running rows through ``ix_tasks_lease_expiry``; locks nothing. Binds ``worker_id``.
OWNED: Final = select(tasks.c.id, tasks.c.attempt, tasks.c.lease_token).where(
    tasks.c.state == literal_column("'running'"),
    tasks.c.lease_owner == bindparam("worker_id", type_=UUID_T),
)
