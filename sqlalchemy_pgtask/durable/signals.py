"""durable.signals: send a named event to a task, inside the caller's transaction, like `enqueue`.

A signal is immutable: the first value committed under (task, name, occurrence) wins, and
sending it again returns the stored value. It may arrive before the task waits for it (it is
kept until the task asks), and a task waiting for it is woken in the sender's transaction, so
the wake-up commits (or rolls back) with the signal.

A task the caller's transaction cannot see is not always missing: under REPEATABLE READ or
SERIALIZABLE it may have been committed after the snapshot, which no statement of that
transaction can tell. Only then, to tell `TaskNotVisible` (retry the transaction) from
`TaskNotFound`, is the task looked up once on another connection of the caller's engine;
nothing is written there, and the caller's transaction is left as it was.
"""

from __future__ import annotations

import uuid
from typing import Any, Final

from sqlalchemy import Engine, Row
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool, QueuePool

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    parse_task_id,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask._prepared import unprepared, unprepared_async
from sqlalchemy_pgtask.errors import PgTaskError, TaskNotFound, TaskNotVisible
from sqlalchemy_pgtask.statements.admin import TASK_STATE
from sqlalchemy_pgtask.validation import (
    INT4_MAX,
    SIGNAL_MAX_BYTES,
    check_int_range,
    check_task_name,
    dump_json,
)

__all__ = ["emit_signal", "emit_signal_async"]

#: Isolation levels whose transaction keeps the snapshot of its first statement.
_SNAPSHOT_LEVELS: Final = frozenset({"repeatable read", "serializable"})
#: Longest an async look-up on another connection may take (a pool at its limit, say).
_LOOK_UP_SECONDS: Final = 10.0


def _params(task_id: object, name: object, value: object, occurrence: object) -> dict[str, Any]:
    return {
        "task": parse_task_id(task_id),
        "signal": check_task_name(name, "name"),
        "signal_occurrence": check_int_range("occurrence", occurrence, 0, INT4_MAX),
        "signal_value": dump_json("value", value, SIGNAL_MAX_BYTES),
    }


def _separate(engine: Engine | AsyncEngine) -> bool:
    """Whether the engine's pool gives another connection than the caller's: a pool that
    shares one (``StaticPool``, ``SingletonThreadPool``) would roll the caller's transaction
    back when the look-up gives it back."""
    return isinstance(engine.pool, (QueuePool, NullPool))


def _look_up(engine: Engine, task_id: uuid.UUID) -> bool | None:
    """Whether the task exists in what is committed now; None if that cannot be asked."""
    if not _separate(engine):
        return None
    try:
        with engine.connect() as other, unprepared(other):
            return other.execute(TASK_STATE, {"task_id": task_id}).first() is not None
    except Exception:  # an answer to improve an error, never a new error
        return None


async def _look_up_async(engine: AsyncEngine, task_id: uuid.UUID) -> bool | None:
    if not _separate(engine):
        return None

    async def read() -> bool:
        async with engine.connect() as other, unprepared_async(other):
            found = await other.execute(TASK_STATE, {"task_id": task_id})
            return found.first() is not None

    try:
        return await bounded(read(), _LOOK_UP_SECONDS)
    except Exception:
        return None


def _unseen(row: Row[Any]) -> bool:
    """Whether a task this transaction did not see may exist (committed after its snapshot)."""
    return row.isolation in _SNAPSHOT_LEVELS


def _missing(task_id: uuid.UUID, exists: bool | None) -> PgTaskError:
    if exists:
        return TaskNotVisible(
            f"task {task_id} was committed after this transaction's snapshot; nothing was "
            "written: roll back and retry the transaction (SQLSTATE 40001)"
        )
    return TaskNotFound(f"no task with id {task_id}")


def emit_signal(
    bind: SyncBind,
    task_id: uuid.UUID | str,
    name: str,
    value: Any = None,
    *,
    occurrence: int = 0,
) -> Any:
    """Send signal ``name`` (occurrence ``occurrence``) with a JSON ``value`` to a task.

    Runs one statement in ``bind``'s transaction and never commits: the signal exists, and
    its waiter wakes, once the caller commits. Returns the stored value: ``value``, or the
    value of the same signal sent earlier (the first one wins; a signal never changes).

    :param name: the signal's name (the task-name rule: letters, digits, ``._:-``).
    :param occurrence: which event of that name (0, 1, ...), for signals that repeat.
    :raises ValidationError: on bad input, before any SQL runs.
    :raises TaskNotFound: there is no such task; nothing was written.
    :raises TaskNotVisible: the transaction (REPEATABLE READ or SERIALIZABLE) took its
        snapshot before the task was committed: a serialization failure (SQLSTATE 40001);
        nothing was written: retry the transaction.
    """
    target = sync_bind(bind, "emit_signal")
    params = _params(task_id, name, value, occurrence)
    connection = connection_of(target)
    with translated_errors(connection):
        row = connection.execute(statements.EMIT_SIGNAL, params).one()
    if row.found:
        return row.value
    task = params["task"]
    raise _missing(task, _unseen(row) and _look_up(connection.engine, task))


async def emit_signal_async(
    bind: AsyncBind,
    task_id: uuid.UUID | str,
    name: str,
    value: Any = None,
    *,
    occurrence: int = 0,
) -> Any:
    """`emit_signal` for an `AsyncSession` or an `AsyncConnection`."""
    target = async_bind(bind, "emit_signal")
    params = _params(task_id, name, value, occurrence)
    connection = await async_connection_of(target)
    async with unprepared_async(connection):
        with translated_errors():
            row = (await connection.execute(statements.EMIT_SIGNAL, params)).one()
    if row.found:
        return row.value
    task = params["task"]
    raise _missing(task, _unseen(row) and await _look_up_async(connection.engine, task))
