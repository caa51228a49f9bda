"""worker._transactions: ``ctx.transaction(name)``, the fenced application transaction.

The handler's session writes and the step's checkpoint commit in one transaction, which the
step owns (the session joins it through a savepoint: the block cannot commit it early). The
checkpoint is written last, by a statement that also checks the lease fence and locks the
attempt's row ``FOR SHARE`` until the commit: a stale attempt's transaction finds no row and
rolls back whole, and the attempt cannot end (nor the task change hands) between the check
and the commit. Renewals never touch that row, so even a long block at REPEATABLE READ is not
failed by them.

A replay (an earlier attempt committed the block) yields a session that refuses database
access: the block ends quietly at its first statement and nothing is written; the stored
result is in ``result``.
"""

from __future__ import annotations

import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from sqlalchemy import Connection, Engine, Executable, Row, create_engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from sqlalchemy_pgtask._failures import is_serialization_failure
from sqlalchemy_pgtask.durable.types import StepKey
from sqlalchemy_pgtask.statements import CHECKPOINT, SAVE_CHECKPOINT
from sqlalchemy_pgtask.validation import CHECKPOINT_MAX_BYTES, dump_json
from sqlalchemy_pgtask.worker._ports import CallOwner
from sqlalchemy_pgtask.worker._reconnect import is_transient, network_settings

if TYPE_CHECKING:
    from sqlalchemy_pgtask.statements import DurableParams

__all__ = [
    "AsyncTransactionStep", "StepCalls", "StepRuntime", "SyncTransactionStep", "TransactionEngines",
]

_KIND = "transaction"

T = TypeVar("T")


class TransactionEngines:
    """The engines application transactions run on: the worker's, and a synchronous twin
    (made on first use, for ``def`` handlers, from the same URL)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.async_engine = engine
        self._sync: Engine | None = None
        self._lock = threading.Lock()

    def sync_engine(self) -> Engine:
        with self._lock:
            if self._sync is None:
                url = self.async_engine.url.set(drivername="postgresql+psycopg")
                options: dict[str, Any] = {}
                # Decoding JSON as the worker's engine does: a stored value reads the same
                # on the first run (here) and on replays (there).
                decode = getattr(self.async_engine.dialect, "_json_deserializer", None)
                if decode is not None:
                    options["json_deserializer"] = decode
                self._sync = create_engine(
                    url,
                    connect_args=network_settings(url),
                    hide_parameters=True,
                    pool_pre_ping=True,
                    **options,
                )
            return self._sync

    async def close(self) -> None:
        with self._lock:
            engine, self._sync = self._sync, None
        if engine is not None:
            engine.dispose()


class _Refused(BaseException):
    """A replayed transaction block reached the database; ends the block quietly."""


class _ReplaySession(Session):
    """A session for a replayed block: every database access ends the block."""

    def get_bind(self, *args: Any, **kwargs: Any) -> Any:
        raise _Refused("this transaction step was committed by an earlier attempt")


class StepCalls(Protocol):
    """The worker's durable calls (`DurableCalls`), as a transaction step uses them."""

    @property
    def engines(self) -> TransactionEngines: ...

    async def rows(
        self, owner: CallOwner, statement: Executable, params: Mapping[str, Any]
    ) -> Sequence[Row[Any]]: ...


class StepRuntime(CallOwner, Protocol):
    """The attempt a step belongs to (a `DurableAttempt`): a protocol, since that module
    imports this one."""

    @property
    def calls(self) -> StepCalls: ...

    def params(self, key: StepKey) -> DurableParams: ...
    def remember(self, key: StepKey, kind: str, value: Any) -> None: ...
    def replayed_now(self, key: StepKey, kind: str) -> tuple[bool, Any] | None: ...
    async def replayed(self, key: StepKey, kind: str) -> tuple[bool, Any]: ...
    def guard(self) -> None: ...

    async def fence_failed(
        self, *, suspending: bool, unless_ours: BaseException | None = None
    ) -> NoReturn: ...

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T: ...


class _Step:
    def __init__(self, runtime: StepRuntime, key: StepKey) -> None:
        self._runtime = runtime
        self._key = key
        #: The block's JSON result: set it inside the block; afterwards, the stored value.
        self.result: Any = None
        #: An earlier attempt committed this block; nothing was written now.
        self.replayed = False
        self._entered = False
        self._replayed_value: Any = None

    def _begin(self) -> None:
        """Refuse a second entry, before the replay lookup uses up the step key."""
        if self._entered:
            raise RuntimeError("a transaction step is used once")
        self._entered = True

    def _enter(self, found: bool, value: Any) -> None:
        if found:
            self.replayed = True
            self._replayed_value = value
            self.result = value.get("result")

    def _replay_exit(self, exc_type: Any) -> bool:
        """End a replayed block: the stored result wins over whatever the block set."""
        self.result = self._replayed_value.get("result")
        return exc_type is not None and issubclass(exc_type, _Refused)

    def _document(self) -> str:
        return dump_json(f"transaction {self._key[0]!r} result", {"result": self.result},
                         CHECKPOINT_MAX_BYTES)

    def _params(self, document: str) -> dict[str, Any]:
        return {**self._runtime.params(self._key), "kind": _KIND, "value": document}

    def _stored(self, value: Any) -> None:
        self.result = value.get("result")
        self._runtime.remember(self._key, _KIND, value)

    async def _committed(self) -> Any | None:
        """After a commit with an unknown outcome: the stored checkpoint, or None."""
        runtime = self._runtime
        rows = await runtime.calls.rows(runtime, CHECKPOINT, runtime.params(self._key))
        return rows[0].value if rows else None


class AsyncTransactionStep(_Step):
    """``async with ctx.transaction(name) as session``; see `context.TransactionStep`.

    The step owns the transaction: the session joins it through a savepoint, so the block's
    own ``commit()`` or ``rollback()`` only ends that savepoint, and nothing the block writes
    can commit without the checkpoint.
    """

    _session: AsyncSession
    _connection: AsyncConnection | None = None

    async def __aenter__(self) -> AsyncSession:
        self._begin()
        found, value = await self._runtime.replayed(self._key, _KIND)
        self._enter(found, value)
        if self.replayed:
            self._session = AsyncSession(sync_session_class=_ReplaySession)
            return self._session
        connection = await self._runtime.calls.engines.async_engine.connect()
        try:
            await connection.begin()
        except BaseException:
            await connection.close()
            raise
        self._connection = connection
        self._session = AsyncSession(
            bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False
        )
        return self._session

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        session, connection = self._session, self._connection
        try:
            if connection is None:  # a replay: nothing was written
                return self._replay_exit(exc_type)
            if exc_type is None:
                await session.commit()  # releases the session's savepoint, flushed
                await self._commit(connection)
            return False
        finally:
            await session.close()
            if connection is not None:
                await connection.close()  # rolls back whatever was not committed

    async def _commit(self, connection: AsyncConnection) -> None:
        runtime = self._runtime
        document = self._document()
        runtime.guard()
        try:
            row = (await connection.execute(SAVE_CHECKPOINT, self._params(document))).one()
        except DBAPIError as exc:
            # At REPEATABLE READ or above, an attempt row changed since the block's
            # snapshot (its attempt ended) is not skipped by the fence but refused.
            if not is_serialization_failure(exc):
                raise
            await connection.rollback()
            await runtime.fence_failed(suspending=False, unless_ours=exc)
        if not row.held:
            await connection.rollback()
            await runtime.fence_failed(suspending=False)
        if not row.saved:  # an earlier try of this block committed: keep that one
            await connection.rollback()
            found = (await runtime.calls.rows(runtime, CHECKPOINT, runtime.params(self._key)))[0]
            self.replayed = True
            self._stored(found.value)
            return
        try:
            await connection.commit()
        except Exception as exc:
            committed = await self._committed() if is_transient(exc) else None
            if committed is None:
                raise
            self._stored(committed)
            return
        self._stored(row.stored)  # as jsonb keeps it, as a replay reads it


class SyncTransactionStep(_Step):
    """``with ctx.transaction(name) as session`` in a ``def`` handler; see
    `AsyncTransactionStep`."""

    _session: Session
    _connection: Connection | None = None

    def __enter__(self) -> Session:
        self._begin()
        runtime = self._runtime
        replay = runtime.replayed_now(self._key, _KIND)
        found, value = replay if replay is not None else runtime.call(
            runtime.replayed(self._key, _KIND)
        )
        self._enter(found, value)
        if self.replayed:
            self._session = _ReplaySession()
            return self._session
        connection = runtime.calls.engines.sync_engine().connect()
        try:
            connection.begin()
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        self._session = Session(
            bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False
        )
        return self._session

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        session, connection = self._session, self._connection
        try:
            if connection is None:
                return self._replay_exit(exc_type)
            if exc_type is None:
                session.commit()
                self._commit(connection)
            return False
        finally:
            session.close()
            if connection is not None:
                connection.close()

    def _commit(self, connection: Connection) -> None:
        runtime = self._runtime
        document = self._document()
        runtime.guard()
        try:
            row = connection.execute(SAVE_CHECKPOINT, self._params(document)).one()
        except DBAPIError as exc:
            # At REPEATABLE READ or above, an attempt row changed since the block's
            # snapshot (its attempt ended) is not skipped by the fence but refused.
            if not is_serialization_failure(exc):
                raise
            connection.rollback()
            runtime.call(runtime.fence_failed(suspending=False, unless_ours=exc))
        if not row.held:
            connection.rollback()
            runtime.call(runtime.fence_failed(suspending=False))
        if not row.saved:
            connection.rollback()
            found = runtime.call(
                runtime.calls.rows(runtime, CHECKPOINT, runtime.params(self._key))
            )
            self.replayed = True
            self._stored(found[0].value)
            return
        try:
            connection.commit()
        except Exception as exc:
            committed = runtime.call(self._committed()) if is_transient(exc) else None
            if committed is None:
                raise
            self._stored(committed)
            return
        self._stored(row.stored)  # as jsonb keeps it, as a replay reads it
