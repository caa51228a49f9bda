"""durable.types: the types durable calls return and take; the calls themselves are on the context.

`ChildResult` is what ``ctx.wait_for_result`` returns; `TransactionStep` and
`SyncTransactionStep` are what ``ctx.transaction(name)`` returns. `DurableRuntime` is the
worker's side of a context's durable calls (one per attempt).
"""

from __future__ import annotations

import uuid
from collections.abc import Coroutine, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from sqlalchemy_pgtask._defaults import TaskTarget

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

__all__ = [
    "ChildResult",
    "DurableRuntime",
    "StepKey",
    "SyncTransactionStep",
    "TransactionStep",
]

T = TypeVar("T")

#: A checkpoint's key within one handler version: (step name, occurrence).
StepKey = tuple[str, int]


class ChildResult(NamedTuple):
    """How a child task ended, as `wait_for_result` returns it.

    ``state`` is ``"succeeded"``, ``"failed"`` or ``"cancelled"``, or ``"timeout"`` when the
    wait timed out (the child was then cancelled, or asked to stop if it was running).
    """

    state: str
    result: Any
    error: dict[str, Any] | None


class TransactionStep(Protocol):
    """``async with ctx.transaction(name) as session``: the fenced application transaction.

    Set `result` inside the block to a JSON value; after the block it holds the stored value,
    on the first run and on every replay alike. `replayed` is true when an earlier attempt
    committed the block: the session then refuses database access, which ends the block
    quietly at its first statement, and nothing is written.
    """

    result: Any
    replayed: bool

    async def __aenter__(self) -> AsyncSession: ...

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool: ...


class SyncTransactionStep(Protocol):
    """``with ctx.transaction(name) as session`` in a ``def`` handler; see `TransactionStep`."""

    result: Any
    replayed: bool

    def __enter__(self) -> Session: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool: ...


class DurableRuntime(Protocol):
    """What the worker provides to a context for its durable calls (one per attempt)."""

    def key(self, step: object, occurrence: object) -> StepKey:
        """The checked key of a call about to be made; refuses one used in this run but
        reserves nothing: a call uses its key up at its replay lookup, once its own
        arguments are valid, so a call refused for a bad argument leaves the key free."""
        ...

    def replayed_now(self, key: StepKey, kind: str) -> tuple[bool, Any] | None:
        """`replayed` without I/O, or None (reserving nothing) when that needs a read."""
        ...

    async def replayed(self, key: StepKey, kind: str) -> tuple[bool, Any]:
        """Use up ``key``; return (True, value) if an earlier attempt stored its checkpoint."""
        ...

    async def save(self, key: StepKey, kind: str, value: Any) -> Any: ...

    async def sleep(
        self, key: StepKey, *, delay: float | timedelta | None, wake_at: datetime | None
    ) -> None: ...

    async def wait_for_signal(
        self, key: StepKey, signal: object, signal_occurrence: object, timeout: object
    ) -> Any: ...

    async def spawn(
        self, key: StepKey, name: str | TaskTarget, payload: Any,
        options: Mapping[str, Any],
    ) -> uuid.UUID: ...

    async def wait_for_result(
        self, key: StepKey, child_id: object, timeout: object
    ) -> ChildResult: ...

    def transaction(self, key: StepKey) -> TransactionStep: ...

    def sync_transaction(self, key: StepKey) -> SyncTransactionStep: ...

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T: ...
