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
from typing import Any, TypeVar

from sqlalchemy import Executable, Row
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask.control import LeaseLost
from sqlalchemy_pgtask.worker._attempts import AttemptBook
from sqlalchemy_pgtask.worker._ports import CallOwner
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient
from sqlalchemy_pgtask.worker._transactions import TransactionEngines

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
        self.connections = [make_connection() for _ in range(size)]
        for connection in self.connections:
            self._idle.put_nowait(connection)
        #: Told the seconds until a wait just registered times out (its timeout pass).
        self.on_wait = on_wait
        #: The connection each attempt's call in flight uses (by the attempt's id).
        self._using: dict[int, HeldConnection] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}

    @contextlib.asynccontextmanager
    async def _connection(self, owner: object) -> AsyncIterator[AsyncConnection]:
        held = await self._idle.get()
        self._using[id(owner)] = held
        try:
            async with held.use() as connection:
                yield connection
        finally:
            self._using.pop(id(owner), None)
            self._idle.put_nowait(held)

    def sever_for(self, owner: object) -> bool:
        """Sever the connection ``owner``'s durable call waits on, if it is in one: the call
        fails at once (and, the attempt being told to stop, raises `LeaseLost`)."""
        held = self._using.get(id(owner))
        if held is not None and held.sever():
            return True
        call = self._calls.get(id(owner))
        if call is None or call.done():
            return False
        call.cancel()  # taking or opening a connection: no statement in flight to cancel
        return True

    async def _once(
        self, owner: CallOwner, body: Callable[[AsyncConnection], Awaitable[T]],
        transaction: bool,
    ) -> T:
        async with self._connection(owner) as connection:
            if not transaction:
                return await body(connection)
            await connection.exec_driver_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
            result = await body(connection)
            await connection.exec_driver_sql("COMMIT")
            return result

    async def _shielded(
        self, owner: CallOwner, body: Callable[[AsyncConnection], Awaitable[T]],
        transaction: bool,
    ) -> T:
        """`_once` in a task of its own, which a cancellation of the handler never reaches:
        it severs the call's connection instead and waits (briefly) for the call to fail.
        Cancelled, psycopg would send a cancel request and wait for it, up to 10 s on a dead
        path, the handler running on past its lease meanwhile."""
        call = self._calls[id(owner)] = asyncio.ensure_future(self._once(owner, body, transaction))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            if call.cancelled():  # stopped by `sever_for` before it sent anything
                raise LeaseLost(f"task {owner.lease.task_id}: the attempt was stopped") from None
            # Severed, its statement fails at the loop's next turn; not in one yet (taking
            # or opening a connection), it is cancelled at once: no statement to cancel.
            if not call.done() and self.sever_for(owner):
                await asyncio.wait({call}, timeout=0.5)
            call.cancel()  # no-op once it failed
            call.add_done_callback(_retrieve)
            raise
        finally:
            if self._calls.get(id(owner)) is call:
                del self._calls[id(owner)]

    async def run(
        self,
        owner: CallOwner,
        body: Callable[[AsyncConnection], Awaitable[T]],
        *,
        transaction: bool = False,
    ) -> T:
        """Run ``body`` on a held connection (in one transaction if asked), retrying it after
        transient failures for as long as the attempt is not told to stop."""
        backoff = Backoff(base=0.05, cap=2.0)
        while True:
            try:
                return await self._shielded(owner, body, transaction)
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
        self, owner: CallOwner, statement: Executable, params: Mapping[str, Any]
    ) -> Sequence[Row[Any]]:
        async def body(connection: AsyncConnection) -> Sequence[Row[Any]]:
            return (await connection.execute(statement, params)).all()

        return await self.run(owner, body)

    async def close(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(Exception):
                await connection.close()
        await self.engines.close()


def _retrieve(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()  # the handler is gone: nobody else reads it
