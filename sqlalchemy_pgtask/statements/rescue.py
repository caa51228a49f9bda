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

Nor is a lock that stays gone: the server may have ended a live worker's sessions itself
(``pg_terminate_backend``, an idle-session timeout) and refuse its new connections for a while
(``max_connections`` reached, the database closed to connections). PostgreSQL counts, per
database, how sessions ended: a dead client's as *abandoned* (end of file on its socket), the
server's own doing as *killed* or *fatal*. `WORKER_LOCKS` reads the last two, so a rescuer can
tell "its process is gone" from "the server ended its sessions" (PostgreSQL 14 and later).
Leases stay the fence, and the fallback where locks say nothing (a transaction-pooling proxy
keeps them on its own server connections).
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    Integer,
    Select,
    Text,
    any_,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    null,
    select,
    table,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, OID

from sqlalchemy_pgtask.statements._common import TSTZ, UUID_T, not_aside, tasks, workers
from sqlalchemy_pgtask.statements.lease import expired_leases, recover_from

__all__ = [
    "EXPIRED", "LOCK_NAMESPACE", "ORPHANS", "RECOVER_ONE", "RESCUE", "RESCUE_ONE", "WORKER_LOCKS",
    "WORKER_LOCKS_WITHOUT_ENDINGS",
]

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


def _this_database() -> Any:
    return (
        select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery()
    )


def _held_keys() -> CTE:
    """The second keys of the workers' advisory locks held now in this database."""
    this_database = _this_database()
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


def _ended() -> ColumnElement[Any]:
    """How many sessions of this database the server ended (terminated or failed) so far."""
    database = _this_database()
    return (
        func.pg_stat_get_db_sessions_killed(database) + func.pg_stat_get_db_sessions_fatal(database)
    )


def _worker_locks(*, endings: bool) -> Any:
    keys = _held_keys()
    holding = _holds(keys)
    locked = workers.c.lock_key.is_not(None)
    own_start = (
        select(_pg_stat_activity.c.backend_start)
        .where(_pg_stat_activity.c.pid == func.pg_backend_pid())
        .scalar_subquery()
    )
    return select(
        # Read before the locks: a session that ends after this read but before the lock
        # read is seen gone, and counted on the next pass (its backend releases its locks a
        # moment before it reports how it ended).
        (_ended() if endings else cast(null(), BigInteger)).label("ended"),
        func.pg_backend_pid().label("backend"),
        own_start.label("backend_start"),
        select(func.array_agg(workers.c.id)).where(locked, holding).scalar_subquery()
        .label("holding"),
        select(func.array_agg(workers.c.id)).where(locked, ~holding).scalar_subquery()
        .label("gone"),
    )


#: How many sessions of this database the server has ended so far (``ended``: terminated or
#: ended by a fatal error, never those whose client went away), this session's identity
#: (``backend`` pid and ``backend_start``) and the workers (with a lock key) whose advisory
#: lock is held now (``holding``) or not (``gone``), as arrays (NULL when empty). A worker
#: takes its lock before it registers, so one whose row a session reads for the first time
#: held it after that session's previous read: no clock is compared (the database clock may
#: be moved). Reads ``pg_locks`` once and this database's session counters. Locks nothing.
WORKER_LOCKS: Final = _worker_locks(endings=True)
#: `WORKER_LOCKS` for PostgreSQL 13, which does not count how sessions ended: ``ended`` is
#: NULL.
WORKER_LOCKS_WITHOUT_ENDINGS: Final = _worker_locks(endings=False)


def _orphans(*, one: bool) -> Select[Any]:
    keys = _held_keys()
    still_gone = select(workers.c.id).where(
        workers.c.id == any_(bindparam("owners", type_=ARRAY(UUID_T))),
        workers.c.lock_key.is_not(None),
        ~_holds(keys),
    )
    chosen = tasks.c.id == bindparam("task", type_=UUID_T) if one else not_aside(tasks.c.id)
    return (
        select(tasks.c.id)
        .where(tasks.c.state == literal_column("'running'"), tasks.c.lease_owner.in_(still_gone),
               chosen)
        .order_by(tasks.c.id)
        .limit(1 if one else bindparam("limit", type_=Integer))
    )


def _rescue(*, one: bool) -> Any:
    orphans = _orphans(one=one).with_for_update(skip_locked=True, key_share=True).cte("orphans")
    return recover_from(orphans, _GONE_ERROR)


#: Takes back up to ``limit`` running tasks of the workers ``owners`` whose advisory lock is
#: (still) gone, as `RECOVER` does for expired leases, without waiting for the lease: the lost
#: attempt counts as failed (error ``lease_expired``, reason ``worker_gone``). Reads the
#: running tasks through ``ix_tasks_lease_expiry``; locks the orphans ``SKIP LOCKED``.
#: Returns ``(id, state)``. Leaves out the tasks in ``aside`` (default none).
RESCUE: Final = _rescue(one=False)

#: The ids `RESCUE` would take (up to ``limit``, none of ``aside``), read without locking:
#: after a batch that failed, each is taken alone (`RESCUE_ONE`), so one never holds back the
#: others. Binds ``owners``, ``limit``, ``aside``.
ORPHANS: Final = _orphans(one=False)

#: `RESCUE` for the one task ``task`` (if it is still an orphan of ``owners``).
RESCUE_ONE: Final = _rescue(one=True)

#: The ids `statements.RECOVER` would take (up to ``limit``, none of ``aside``), read without
#: locking, earliest expiry first.
EXPIRED: Final = expired_leases(one=False)

#: `statements.RECOVER` for the one task ``task`` (if its lease has expired): tried alone after
#: a batch failed. Returns ``(id, state)``.
RECOVER_ONE: Final = recover_from(
    expired_leases(one=True).with_for_update(skip_locked=True, key_share=True).cte("expired")
)
