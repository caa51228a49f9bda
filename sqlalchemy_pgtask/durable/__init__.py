"""durable: the durable workflow API a handler uses, and signals a producer sends.

`context` holds the handler's context and its durable calls (steps, sleeps, signal and child
waits, fenced transactions); `types` the values those calls return and take, and the
protocol the worker implements behind them; `signals` sends a named event to a task inside
the caller's transaction. See ``docs/durable.md``.
"""

from __future__ import annotations

from sqlalchemy_pgtask.durable.context import (
    BaseTaskContext,
    StopReason,
    SyncTaskContext,
    TaskContext,
)
from sqlalchemy_pgtask.durable.signals import (
    emit_signal,
    emit_signal_async,
)
from sqlalchemy_pgtask.durable.types import (
    ChildResult,
    DurableRuntime,
    StepKey,
    SyncTransactionStep,
    TransactionStep,
)

__all__ = [
    "BaseTaskContext",
    "ChildResult",
    "DurableRuntime",
    "StepKey",
    "StopReason",
    "SyncTaskContext",
    "SyncTransactionStep",
    "TaskContext",
    "TransactionStep",
    "emit_signal",
    "emit_signal_async",
]
