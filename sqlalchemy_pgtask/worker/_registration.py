"""worker._registration: the worker's row, its capabilities and its frozen handler policies.

Registration runs in one transaction: the policies are frozen (the first worker to register an
identity decides them) and compared with this worker's, and a conflict rolls everything back
before the worker claims anything. The heartbeat then keeps the row live (and says when the
worker drains); a row that disappeared (pruned while this process was suspended) is written
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._version import __version__
from sqlalchemy_pgtask.errors import PolicyConflict
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements import Capability
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient
from sqlalchemy_pgtask.worker._schedule import reconcile_schedules

__all__ = ["Registration"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")


class Registration:
    def __init__(
        self,
        *,
        engine: AsyncEngine,
        connection: HeldConnection,
        worker_id: uuid.UUID,
        queues: Sequence[str],
        capabilities: Sequence[Capability],
        concurrency: int,
        heartbeat_interval: float,
        ttl: float,
        lock_timeout: float,
        declared: Registry | None = None,
        lock_key: int | None = None,
    ) -> None:
        self._engine = engine
        self._connection = connection
        self._worker_id = worker_id
        self._queues = list(queues)
        self._capabilities = list(capabilities)
        self._concurrency = concurrency
        self._interval = heartbeat_interval
        self._ttl = ttl
        self._lock_timeout = lock_timeout
        #: A registry whose declared schedules are reconciled with the registration.
        self._declared = declared
        self._lock_key = lock_key
        self.draining = False

    async def register(self) -> None:

        async with self._engine.begin() as conn:
            lock_timeout = f"{max(1, round(self._lock_timeout * 1000))}ms"
            await conn.execute(select(func.set_config("lock_timeout", lock_timeout, True)))
            await conn.execute(
                statements.REGISTER_POLICIES, statements.policy_params(self._capabilities)
            )
            stored = (
                await conn.execute(
                    statements.STORED_POLICIES, statements.identity_params(self._capabilities)
                )
            ).all()
            frozen = {(r.queue, r.name, r.version): r for r in stored}
            for capability in self._capabilities:
                row = frozen[(capability.queue, capability.name, capability.version)]
                retry = RetryPolicy.from_row(row)
                stored_keys = (row.concurrency_limit, row.concurrency_scope)
                own_keys = (capability.concurrency_limit, capability.concurrency_scope)
                if (
                    retry != capability.retry or row.max_attempts != capability.max_attempts
                    or stored_keys != own_keys
                ):
                    # max_attempts is never NULL here: registering froze a missing one.
                    raise PolicyConflict(
                        f"{capability.name!r} version {capability.version} on queue "
                        f"{capability.queue!r} has the retry policy {retry}, max_attempts "
                        f"{row.max_attempts} and concurrency (limit, scope) {stored_keys} in "
                        f"the database, but this worker registers {capability.retry}, "
                        f"max_attempts {capability.max_attempts} and {own_keys}; policies "
                        "are immutable, so register the new policy under a new version"
                    )
            worker: statements.RegisterParams = {
                "worker_id": self._worker_id,
                "queues": self._queues,
                "version": __version__,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "concurrency": self._concurrency,
                "ttl_seconds": float(self._ttl),
                "lock_key": self._lock_key,
            }
            await conn.execute(statements.REGISTER_WORKER, worker)
            await conn.execute(statements.CLEAR_CAPABILITIES, {"worker_id": self._worker_id})
            await conn.execute(
                statements.ADD_CAPABILITIES,
                {"worker_id": self._worker_id, **statements.identity_params(self._capabilities)},
            )
            if self._declared is not None:
                await reconcile_schedules(conn, self._declared)

    async def heartbeat(self) -> None:
        beat: statements.HeartbeatParams = {
            "worker_id": self._worker_id,
            "ttl_seconds": float(self._ttl),
            "draining": self.draining,
        }
        async with self._connection.use() as conn:
            alive = (await conn.execute(statements.HEARTBEAT, beat)).first()
        if alive is None and not self.draining:
            logger.warning("worker row %s disappeared; registering again", self._worker_id)
            await self.register()

    async def run(self) -> None:
        backoff = Backoff(cap=self._interval)
        while True:
            wait = self._interval
            try:
                await self.heartbeat()
                backoff.reset()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                wait = backoff.next()
                logger.warning("heartbeat failed (%s); retrying in %.2fs", brief(exc), wait)
            await asyncio.sleep(wait)

    async def retire(self, timeout: float) -> None:
        """Mark the worker gone at once, so operators and routing see it leave."""

        with contextlib.suppress(Exception):  # severed at the deadline, never cancelled
            async with self._connection.use(deadline=timeout) as conn:
                await conn.execute(statements.RETIRE_WORKER, {"worker_id": self._worker_id})
