"""statements.rescue: the tasks of workers that died, taken back at once; no I/O.

Every connection a worker keeps holds one advisory lock in shared mode, ``(LOCK_NAMESPACE,
lock_key)``, for as long as it is open; PostgreSQL releases a session's locks when its backend
ends. When the last of a worker's connections is gone (the process was killed, its host died),
its lock is gone.

A lock that is gone is not enough: after a crash-restart of the server, a failover or a
network blip, live workers' locks are gone too until they reconnect. So a rescuer only takes
back the tasks of a worker it knows held its lock *during the life of the same backend of its
own* (seen holding it, or registered since: a worker takes its lock before it registers), so
its session outlived whatever happened and the worker could have reconnected; and only when
the lock was still missing one pass later (`worker._maintenance.Rescue` keeps that memory).
Leases stay the fence, and the fallback where locks say nothing (a transaction-pooling proxy
keeps them on its own server connections).
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    CTE,
    ColumnElement,
    Integer,
    Text,
    any_,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    select,
    table,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, OID

from sqlalchemy_pgtask.statements._common import TSTZ, UUID_T, tasks, workers
from sqlalchemy_pgtask.statements.lease import recover_from

__all__ = ["LOCK_NAMESPACE", "RESCUE", "WORKER_LOCKS"]

#: The first key of every worker's advisory lock ("pgta"); the second is the worker's
#: ``lock_key`` (1 to 2**31 - 1, random: two workers sharing one only delay a rescue).
LOCK_NAMESPACE: Final = 0x70677461

_pg_locks = table(
    "pg_locks",
    column("locktype", Text), column("database", OID), column("classid", OID),
    column("objid", OID), column("objsubid", Integer),
    schema="pg_catalog",
)
_pg_database = table("pg_database", column("oid", OID), column("datname", Text),
                     schema="pg_catalog")
_pg_stat_activity = table("pg_stat_activity", column("pid", Integer),
                          column("backend_start", TSTZ), schema="pg_catalog")
_GONE_ERROR: Final = cast(
    literal_column("""'{"type": "lease_expired", "reason": "worker_gone"}'"""), JSONB
)


def _held_keys() -> CTE:
    """The second keys of the workers' advisory locks held now in this database."""
    this_database = (
        select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery()
    )
    return (
        select(_pg_locks.c.objid)
        .where(
            _pg_locks.c.locktype == literal_column("'advisory'"),
            _pg_locks.c.database == this_database,
            _pg_locks.c.classid == cast(literal_column(str(LOCK_NAMESPACE)), OID),
            _pg_locks.c.objsubid == literal_column("2"),
        )
        .cte("held_keys")
    )


def _holds(keys: CTE) -> ColumnElement[bool]:
    return cast(workers.c.lock_key, OID).in_(select(keys.c.objid))


def _worker_locks() -> Any:
    keys = _held_keys()
    holding = _holds(keys)
    locked = workers.c.lock_key.is_not(None)
    own_start = (
        select(_pg_stat_activity.c.backend_start)
        .where(_pg_stat_activity.c.pid == func.pg_backend_pid())
        .scalar_subquery()
    )
    return select(
        func.pg_backend_pid().label("backend"),
        own_start.label("backend_start"),
        select(func.array_agg(workers.c.id)).where(locked, holding).scalar_subquery()
        .label("holding"),
        select(func.array_agg(workers.c.id)).where(locked, ~holding).scalar_subquery()
        .label("gone"),
    )


#: This session's identity (``backend`` pid and ``backend_start``) and the workers (with a
#: lock key) whose advisory lock is held now (``holding``) or not (``gone``), as arrays (NULL
#: when empty). A worker takes its lock before it registers, so one whose row a session reads
#: for the first time held it after that session's previous read: no clock is compared (the
#: database clock may be moved). Reads ``pg_locks`` once. Locks nothing.
WORKER_LOCKS: Final = _worker_locks()


def _rescue() -> Any:
    keys = _held_keys()
    still_gone = select(workers.c.id).where(
        workers.c.id == any_(bindparam("owners", type_=ARRAY(UUID_T))),
        workers.c.lock_key.is_not(None),
        ~_holds(keys),
    )
    orphans = (
        select(tasks.c.id)
        .where(tasks.c.state == literal_column("'running'"), tasks.c.lease_owner.in_(still_gone))
        .order_by(tasks.c.id)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("orphans")
    )
    return recover_from(orphans, _GONE_ERROR)


#: Takes back up to ``limit`` running tasks of the workers ``owners`` whose advisory lock is
#: (still) gone, as `RECOVER` does for expired leases, without waiting for the lease: the lost
#: attempt counts as failed (error ``lease_expired``, reason ``worker_gone``). Reads the
#: running tasks through ``ix_tasks_lease_expiry``; locks the orphans ``SKIP LOCKED``.
#: Returns ``(id, state)``.
RESCUE: Final = _rescue()
