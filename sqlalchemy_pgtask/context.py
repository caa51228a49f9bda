"""context: what a running handler knows about its task, and how it learns it must stop.

A `TaskContext` is handed to every handler call. It never talks to the database by itself in
this release; durable steps, sleeps and signals will be added here and will all be fenced by
the attempt's lease.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy_pgtask.control import LeaseLost, TaskCancelled

__all__ = ["StopReason", "TaskContext"]

#: Why a handler is asked to stop: someone cancelled the task; this attempt lost its lease; its
#: lease could not be renewed and would expire before renewal succeeds (the worker hands the
#: task back); or the worker is shutting down and hands the task back.
StopReason = Literal["cancelled", "lease_lost", "lease_expiring", "shutdown"]


@dataclass(eq=False)
class TaskContext:
    """The task being run and the attempt running it.

    Asynchronous handlers are stopped by cancelling their coroutine (``finally`` blocks run).
    Synchronous handlers run in a thread and cannot be interrupted: they should look at
    `cancelled` (or call `check`) between units of work.
    """

    task_id: uuid.UUID
    name: str
    version: int
    queue: str
    #: The claim number, starting at 1; counts every claim of the task.
    attempt: int
    #: How many earlier attempts failed; only these count against ``max_attempts``.
    failed_attempts: int
    max_attempts: int
    headers: dict[str, Any]
    worker_id: uuid.UUID
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _reason: StopReason | None = field(default=None, repr=False)

    @property
    def cancelled(self) -> bool:
        """True once the handler should stop (cancellation, lost lease or shutdown)."""
        return self._stop.is_set()

    @property
    def stop_reason(self) -> StopReason | None:
        """Why `cancelled` is true, or None while the handler may go on."""
        return self._reason

    def check(self) -> None:
        """Raise `TaskCancelled` or `LeaseLost` if the handler should stop; else return."""
        if not self._stop.is_set():
            return
        if self._reason == "cancelled":
            raise TaskCancelled(f"task {self.task_id} was cancelled")
        raise LeaseLost(f"attempt {self.attempt} of task {self.task_id} no longer owns it")

    def request_stop(self, reason: StopReason) -> bool:
        """Ask the handler to stop; the first reason wins. Returns True if this call set it."""
        if self._stop.is_set():
            return False
        self._reason = reason
        self._stop.set()
        return True
