"""statements.workers: worker registration, heartbeats, frozen handler policies, pruning; no I/O."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Final, TypedDict

from sqlalchemy import (
    Boolean,
    Double,
    Insert,
    Integer,
    TableValuedAlias,
    Text,
    bindparam,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import Insert as PgInsert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningDelete

from sqlalchemy_pgtask.retry import PolicyArrays, RetryPolicy
from sqlalchemy_pgtask.statements._common import (
    NOW,
    UUID_T,
    arrays,
    capabilities,
    policies,
    seconds,
    workers,
)
from sqlalchemy_pgtask.statements.claim import Capability

__all__ = [
    "ADD_CAPABILITIES",
    "CLEAR_CAPABILITIES",
    "HEARTBEAT",
    "POLICY_COLUMNS",
    "PRUNE_WORKERS",
    "REGISTER_POLICIES",
    "REGISTER_WORKER",
    "RETIRE_WORKER",
    "STORED_POLICIES",
    "HeartbeatParams",
    "IdentityParams",
    "PolicyParams",
    "RegisterParams",
    "identity_params",
    "policy_params",
]


class RegisterParams(TypedDict):
    worker_id: uuid.UUID
    queues: list[str]
    version: str
    hostname: str
    pid: int
    concurrency: int
    ttl_seconds: float
    lock_key: int | None


class HeartbeatParams(TypedDict):
    worker_id: uuid.UUID
    ttl_seconds: float
    draining: bool


class IdentityParams(TypedDict):
    """(queue, name, version) triples as parallel arrays."""

    queues: list[str]
    names: list[str]
    versions: list[int]


class PolicyParams(IdentityParams, PolicyArrays):
    max_attempts: list[int]
    concurrency_limits: list[int | None]
    concurrency_scopes: list[str]


def identity_params(served: Sequence[Capability]) -> IdentityParams:
    return {
        "queues": [c.queue for c in served],
        "names": [c.name for c in served],
        "versions": [c.version for c in served],
    }


def policy_params(served: Sequence[Capability]) -> PolicyParams:
    return {
        **identity_params(served),
        **RetryPolicy.as_arrays([c.retry for c in served]),
        "max_attempts": [c.max_attempts for c in served],
        "concurrency_limits": [c.concurrency_limit for c in served],
        "concurrency_scopes": [c.concurrency_scope for c in served],
    }


def _register_worker() -> PgInsert:
    values = {
        "id": bindparam("worker_id", type_=UUID_T),
        "queues": bindparam("queues", type_=ARRAY(Text)),
        "version": bindparam("version", type_=Text),
        "hostname": bindparam("hostname", type_=Text),
        "pid": bindparam("pid", type_=Integer),
        "concurrency": bindparam("concurrency", type_=Integer),
        "lock_key": bindparam("lock_key", type_=Integer),
        "draining": False,
        "started_at": NOW,
        "heartbeat_at": NOW,
        "expires_at": NOW + seconds(bindparam("ttl_seconds", type_=Double)),
    }
    statement = pg_insert(workers).values(values)
    return statement.on_conflict_do_update(
        index_elements=[workers.c.id],
        set_={
            name: statement.excluded[name]
            for name in ("queues", "version", "hostname", "pid", "concurrency", "heartbeat_at",
                         "expires_at", "draining", "lock_key")
        },
    )


#: Upserts this worker's row as live (not draining) until database time + ``ttl_seconds``,
#: with the key of the advisory lock its connections hold. Binds `RegisterParams`.
REGISTER_WORKER: Final = _register_worker()

#: Deletes a worker's capabilities before they are written again. Binds ``worker_id``.
CLEAR_CAPABILITIES: Final = capabilities.delete().where(
    capabilities.c.worker_id == bindparam("worker_id", type_=UUID_T)
)


def _identities() -> TableValuedAlias:
    return arrays(
        "identity",
        ("queues", "queue", Text()),
        ("names", "name", Text()),
        ("versions", "version", Integer()),
    )


def _add_capabilities() -> Insert:
    rows = _identities()
    return insert(capabilities).from_select(
        ["worker_id", "queue", "name", "version"],
        select(bindparam("worker_id", type_=UUID_T), rows.c.queue, rows.c.name, rows.c.version),
    )


#: Records the (queue, name, version) triples a worker can run, for operators' eyes. Binds
#: ``worker_id`` and `IdentityParams`.
ADD_CAPABILITIES: Final = _add_capabilities()

POLICY_COLUMNS: Final = (
    "queue", "name", "version", "retry_kind", "retry_base_seconds", "retry_factor",
    "retry_max_seconds", "retry_jitter", "max_attempts", "concurrency_limit",
    "concurrency_scope",
)


def _register_policies() -> PgInsert:
    rows = arrays(
        "policy",
        ("queues", "queue", Text()),
        ("names", "name", Text()),
        ("versions", "version", Integer()),
        ("retry_kinds", "retry_kind", Text()),
        ("retry_bases", "retry_base_seconds", Double()),
        ("retry_factors", "retry_factor", Double()),
        ("retry_maxes", "retry_max_seconds", Double()),
        ("retry_jitters", "retry_jitter", Boolean()),
        ("max_attempts", "max_attempts", Integer()),
        ("concurrency_limits", "concurrency_limit", Integer()),
        ("concurrency_scopes", "concurrency_scope", Text()),
    )
    statement = pg_insert(policies).from_select(
        list(POLICY_COLUMNS), select(*(rows.c[c] for c in POLICY_COLUMNS))
    )
    # Nothing frozen changes; only a max_attempts never frozen (NULL: frozen before the
    # column existed) is set by the first worker that registers the identity again.
    return statement.on_conflict_do_update(
        index_elements=["queue", "name", "version"],
        set_={
            "max_attempts": func.coalesce(
                policies.c.max_attempts, statement.excluded.max_attempts
            )
        },
    )


#: Freezes the policy (retry and attempt budget) of each (queue, name, version) the first time
#: any worker registers it; an existing policy is never changed (except a ``max_attempts``
#: frozen as NULL before it existed). Locks the identities' rows. Binds `PolicyParams`.
REGISTER_POLICIES: Final = _register_policies()

#: The frozen policies of the given identities, to compare with a worker's own. Binds
#: `IdentityParams`.
STORED_POLICIES: Final = select(*(policies.c[c] for c in POLICY_COLUMNS)).where(
    func.row(policies.c.queue, policies.c.name, policies.c.version).in_(
        select(*_identities().c)
    )
)

#: Refreshes a worker's liveness (and its draining flag). Returns its id, or no row if the
#: worker row was deleted and the worker must register again. Binds `HeartbeatParams`.
HEARTBEAT: Final = (
    update(workers)
    .where(workers.c.id == bindparam("worker_id", type_=UUID_T))
    .values(
        heartbeat_at=NOW,
        expires_at=NOW + seconds(bindparam("ttl_seconds", type_=Double)),
        draining=bindparam("draining", type_=Boolean),
    )
    .returning(workers.c.id)
)

#: Marks a worker gone (expired, draining) when it stops, so operators see it leave at once.
#: Binds ``worker_id``.
RETIRE_WORKER: Final = (
    update(workers)
    .where(workers.c.id == bindparam("worker_id", type_=UUID_T))
    .values(expires_at=NOW, heartbeat_at=NOW, draining=True)
)


def _prune_workers() -> ReturningDelete[Any]:
    gone = (
        select(workers.c.id)
        .where(workers.c.expires_at <= NOW - seconds(bindparam("retention_seconds", type_=Double)))
        .order_by(workers.c.expires_at)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return workers.delete().where(workers.c.id.in_(gone)).returning(workers.c.id)


#: Deletes up to ``limit`` worker rows that expired more than ``retention_seconds`` ago (their
#: capabilities cascade), skipping rows others hold. Served by ``ix_workers_expires_at``.
#: Returns the deleted ids.
PRUNE_WORKERS: Final = _prune_workers()
