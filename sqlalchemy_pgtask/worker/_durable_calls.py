"""worker._durable_calls: the connections handlers' durable calls run on, and their retries.

A few held autocommit connections serve the one-statement calls (a checkpoint, a sleep, a
spawn) and the short transactions that register waits; an application transaction
(``ctx.transaction``) uses the engines of `TransactionEngines` instead. A transient failure
is retried with backoff for as long as the attempt is not told to stop; the retried call is
idempotent per step key and fenced by the lease, so sending it again is always safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Executable, Row
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask.control import LeaseLost
from sqlalchemy_pgtask.worker._attempts import AttemptBook
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient
from sqlalchemy_pgtask.worker._transactions import TransactionEngines

if TYPE_CHECKING:
    from sqlalchemy_pgtask.worker._durable import DurableAttempt

__all__ = ["DurableCalls"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

T = TypeVar("T")


class DurableCalls:
    """The worker's connections for durable calls, and how a call survives a broken one."""

    def __init__(
        self,
        *,
        book: AttemptBook,
        engines: TransactionEngines,
        make_connection: Callable[[], HeldConnection],
        size: int,
        on_wait: Callable[[float], None],
    ) -> None:
        self.book = book
        self.engines = engines
        self._idle: asyncio.Queue[HeldConnection] = asyncio.Queue()
        self._connections = [make_connection() for _ in range(size)]
        for connection in self._connections:
            self._idle.put_nowait(connection)
        #: Told the seconds until a wait just registered times out (its timeout pass).
        self.on_wait = on_wait

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection]:
        held = await self._idle.get()
        try:
            async with held.use() as connection:
                yield connection
        finally:
            self._idle.put_nowait(held)

    async def run(
        self,
        owner: DurableAttempt,
        body: Callable[[AsyncConnection], Awaitable[T]],
        *,
        transaction: bool = False,
    ) -> T:
        """Run ``body`` on a held connection (in one transaction if asked), retrying it after
        transient failures for as long as the attempt is not told to stop."""
        backoff = Backoff(base=0.05, cap=2.0)
        while True:
            try:
                async with self._connection() as connection:
                    if not transaction:
                        return await body(connection)
                    await connection.exec_driver_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
                    result = await body(connection)
                    await connection.exec_driver_sql("COMMIT")
                    return result
            except Exception as exc:
                if not is_transient(exc):
                    raise
                owner.retried = True
                if owner.ctx.stop_reason is not None:
                    raise LeaseLost(f"task {owner.lease.task_id}: {brief(exc)}") from exc
                wait = backoff.next()
                logger.warning(
                    "task %s: a durable call failed (%s); again in %.2fs",
                    owner.lease.task_id, brief(exc), wait,
                )
                await asyncio.sleep(wait)

    async def rows(
        self, owner: DurableAttempt, statement: Executable, params: Mapping[str, Any]
    ) -> Sequence[Row[Any]]:
        async def body(connection: AsyncConnection) -> Sequence[Row[Any]]:
            return (await connection.execute(statement, params)).all()

        return await self.run(owner, body)

    async def close(self) -> None:
        for connection in self._connections:
            with contextlib.suppress(Exception):
                await connection.close()
        await self.engines.close()
