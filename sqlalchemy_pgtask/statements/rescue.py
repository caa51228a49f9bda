"""statements.rescue: the tasks of workers that died, taken back at once; no I/O.

Every connection a worker keeps holds one advisory lock in shared mode, ``(LOCK_NAMESPACE,
lock_key)``, for as long as it is open. PostgreSQL releases a session's locks when its backend
ends, so when the last of a worker's connections is gone (the process was killed, or the host
died and its connections were dropped), the lock is gone. A worker counts as dead only when its
row says the lock was held (``locked_at``, written by a heartbeat on such a connection) on this
run of the server: after a restart or a failover every lock is gone, and live workers must
first take theirs again. Leases stay the fence, and the fallback where locks say nothing (a
transaction-pooling proxy keeps them on its own server connections).
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    Integer,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    select,
    table,
)
from sqlalchemy.dialects.postgresql import JSONB, OID

from sqlalchemy_pgtask.statements._common import tasks, workers
from sqlalchemy_pgtask.statements.lease import recover_from

__all__ = ["LOCK_NAMESPACE", "RESCUE"]

#: The first key of every worker's advisory lock ("pgta"); the second is the worker's
#: ``lock_key`` (1 to 2**31 - 1, random: two workers sharing one only delay a rescue).
LOCK_NAMESPACE: Final = 0x70677461

_pg_locks = table(
    "pg_locks",
    column("locktype"), column("database", OID), column("classid", OID),
    column("objid", OID), column("objsubid", Integer), column("granted"),
    schema="pg_catalog",
)
_pg_database = table("pg_database", column("oid", OID), column("datname"), schema="pg_catalog")
_GONE_ERROR: Final = cast(
    literal_column("""'{"type": "lease_expired", "reason": "worker_gone"}'"""), JSONB
)


def _rescue() -> Any:
    this_database = (
        select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery()
    )
    held = (
        select(literal_column("1"))
        .select_from(_pg_locks)
        .where(
            _pg_locks.c.locktype == "advisory",
            _pg_locks.c.database == this_database,
            _pg_locks.c.classid == cast(literal_column(str(LOCK_NAMESPACE)), OID),
            _pg_locks.c.objid == cast(workers.c.lock_key, OID),
            _pg_locks.c.objsubid == 2,
        )
        .exists()
    )
    dead = select(workers.c.id).where(
        workers.c.lock_key.is_not(None),
        workers.c.locked_at > func.pg_postmaster_start_time(),
        ~held,
    )
    orphans = (
        select(tasks.c.id)
        .where(tasks.c.state == literal_column("'running'"), tasks.c.lease_owner.in_(dead))
        .order_by(tasks.c.id)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("orphans")
    )
    return recover_from(orphans, _GONE_ERROR)


#: Takes back up to ``limit`` running tasks whose worker is gone (its advisory lock released
#: since it last held it on this run of the server), as `RECOVER` does for expired leases,
#: without waiting for the lease: the lost attempt counts as failed (error ``lease_expired``,
#: reason ``worker_gone``). Reads ``pg_locks`` once and the running tasks through
#: ``ix_tasks_lease_expiry``; locks the orphans ``SKIP LOCKED``. Returns ``(id, state)``.
RESCUE: Final = _rescue()
