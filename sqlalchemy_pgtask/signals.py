"""signals: send a named event to a task, inside the caller's transaction, like `enqueue`.

A signal is immutable: the first value committed under (task, name, occurrence) wins, and
sending it again returns the stored value. It may arrive before the task waits for it (it is
kept until the task asks), and a task waiting for it is woken in the sender's transaction, so
the wake-up commits (or rolls back) with the signal.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy_pgtask import statements
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
from sqlalchemy_pgtask.validation import (
    INT4_MAX,
    SIGNAL_MAX_BYTES,
    check_int_range,
    check_task_name,
    dump_json,
)

__all__ = ["emit_signal", "emit_signal_async"]


def _params(task_id: object, name: object, value: object, occurrence: object) -> dict[str, Any]:
    return {
        "task": parse_task_id(task_id),
        "signal": check_task_name(name, "name"),
        "signal_occurrence": check_int_range("occurrence", occurrence, 0, INT4_MAX),
        "signal_value": dump_json("value", value, SIGNAL_MAX_BYTES),
    }


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
    :raises TaskNotFound: there is no such task (the transaction is then aborted).
    """
    target = sync_bind(bind, "emit_signal")
    params = _params(task_id, name, value, occurrence)
    with translated_errors():
        return connection_of(target).execute(statements.EMIT_SIGNAL, params).scalar_one()


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
    with translated_errors():
        return (await connection.execute(statements.EMIT_SIGNAL, params)).scalar_one()
