"""states: the names of task and attempt states, typed; the one place they are spelled.

The database stores states as text with a CHECK constraint (never a PostgreSQL ENUM, whose values
cannot be removed by a migration). Code compares and writes states only through these names, so
a typo is a type error rather than a query that silently matches nothing.

Task states::

    pending ──claim──▶ running ──complete──▶ succeeded
       ▲                │  │ ╰──fail (no retry left)──▶ failed
       ╰─retry/release/─╯  ╰──signal or child wait──▶ waiting ──wake or timeout──▶ pending
         durable sleep
    pending / waiting ──cancel──▶ cancelled;  running ──cancel request──▶ cancelled at its end
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "ACTIVE_STATES",
    "ATTEMPT_STATES",
    "CANCELLED",
    "FAILED",
    "PENDING",
    "RUNNING",
    "SUCCEEDED",
    "TASK_STATES",
    "TERMINAL_STATES",
    "WAITING",
    "AttemptState",
    "TaskState",
]

#: Where a task is in its life; ``succeeded``, ``failed`` and ``cancelled`` are terminal.
TaskState = Literal["pending", "running", "waiting", "succeeded", "failed", "cancelled"]

#: How one attempt (one claim) ended, or ``running`` while it has not.
AttemptState = Literal[
    "running", "succeeded", "failed", "lost", "cancelled", "suspended", "released"
]

PENDING: Final[TaskState] = "pending"
RUNNING: Final[TaskState] = "running"
WAITING: Final[TaskState] = "waiting"
SUCCEEDED: Final[TaskState] = "succeeded"
FAILED: Final[TaskState] = "failed"
CANCELLED: Final[TaskState] = "cancelled"

TASK_STATES: Final[tuple[TaskState, ...]] = get_args(TaskState)
#: Outstanding work: counted against a queue's capacity.
ACTIVE_STATES: Final[tuple[TaskState, ...]] = (PENDING, RUNNING, WAITING)
TERMINAL_STATES: Final[tuple[TaskState, ...]] = (SUCCEEDED, FAILED, CANCELLED)
ATTEMPT_STATES: Final[tuple[AttemptState, ...]] = get_args(AttemptState)
