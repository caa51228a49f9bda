"""durable.context: what a running handler knows about its task, and its durable calls.

An ``async def`` handler gets a `TaskContext`, a plain ``def`` handler a `SyncTaskContext`;
both carry the task's identity (for a scheduled task, its schedule and occurrence too) and
the stop request, and offer the same durable calls (``await``-ed on the first, blocking on
the second):

* ``step(name, fn)``: run ``fn`` once; its JSON result is stored, and a later attempt gets
  the stored value back without calling ``fn``.
* ``transaction(name)``: a SQLAlchemy session whose writes commit together with the step's
  checkpoint, only while this attempt holds its lease: exactly once.
* ``sleep_for`` / ``sleep_until``, ``wait_for_signal``, ``wait_for_result``: suspend the task
  (it holds no worker slot meanwhile) until a database deadline, a signal or a child's end.
* ``spawn``: create a child task exactly once.

A task that suspends or fails runs again *from the top*; every durable call with the same
step name and occurrence then returns what it stored. See ``docs/durable.md``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, TypeVar, overload

from sqlalchemy_pgtask import telemetry
from sqlalchemy_pgtask._defaults import SCHEDULE_HEADER, TaskTarget
from sqlalchemy_pgtask.control import LeaseLost, TaskCancelled
from sqlalchemy_pgtask.durable.types import (
    ChildResult,
    DurableRuntime,
    SyncTransactionStep,
    TransactionStep,
)

__all__ = ["BaseTaskContext", "StopReason", "SyncTaskContext", "TaskContext"]

T = TypeVar("T")

#: Why a handler is asked to stop: someone cancelled the task; this attempt lost its lease; its
#: lease could not be renewed and would expire before renewal succeeds (the worker hands the
#: task back); the worker is shutting down and hands the task back; or the attempt ran past
#: its time limit.
StopReason = Literal["cancelled", "lease_lost", "lease_expiring", "shutdown", "timeout"]

@dataclass(eq=False)
class BaseTaskContext:
    """The task being run and the attempt running it.

    Asynchronous handlers are stopped by cancelling their coroutine (``finally`` blocks run).
    Synchronous handlers run in a thread and cannot be interrupted: they should look at
    `cancelled` (or call `check`) between units of work.
    """

    task_id: uuid.UUID
    name: str
    version: int
    queue: str
    #: The claim number, starting at 1; counts every claim of the task, resumes included.
    attempt: int
    #: How many earlier attempts failed; only these count against ``max_attempts``.
    failed_attempts: int
    max_attempts: int
    headers: dict[str, Any]
    worker_id: uuid.UUID
    #: The schedule that made this task, or None for a task not made by a schedule.
    schedule_name: str | None = None
    #: The occurrence this task runs for (timezone-aware, UTC): the instant its schedule
    #: fell due, not when it ran; None for a task not made by a schedule.
    scheduled_for: datetime | None = None
    #: Set once, from the worker's event loop; a handler's thread only reads it (a plain
    #: attribute: reads and writes of one are atomic, and an Event per task cost ~5 us).
    _reason: StopReason | None = field(default=None, repr=False)
    _durable: DurableRuntime | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # The materialiser records the occurrence in a reserved header; the handler reads it
        # from the context, and sees the headers the schedule was given.
        if SCHEDULE_HEADER in self.headers:
            self.schedule_name, self.scheduled_for = _occurrence(
                self.headers.pop(SCHEDULE_HEADER)
            )

    @property
    def cancelled(self) -> bool:
        """True once the handler should stop (cancellation, lost lease or shutdown)."""
        return self._reason is not None

    @property
    def stop_reason(self) -> StopReason | None:
        """Why `cancelled` is true, or None while the handler may go on."""
        return self._reason

    def check(self) -> None:
        """Raise `TaskCancelled` or `LeaseLost` if the handler should stop; else return."""
        if self._reason is None:
            return
        if self._reason == "cancelled":
            raise TaskCancelled(f"task {self.task_id} was cancelled")
        raise LeaseLost(f"attempt {self.attempt} of task {self.task_id} no longer owns it")

    def request_stop(self, reason: StopReason) -> bool:
        """Ask the handler to stop; the first reason wins. Returns True if this call set it."""
        if self._reason is not None:
            return False
        self._reason = reason
        return True

    def _runtime(self) -> DurableRuntime:
        if self._durable is None:
            raise RuntimeError(
                "durable calls need a worker: this context was not made by one (call the "
                "handler through a Worker, or see sqlalchemy_pgtask.testing)"
            )
        return self._durable


@dataclass(eq=False)
class TaskContext(BaseTaskContext):
    """The context of an ``async def`` handler; its durable calls are awaited."""

    @overload
    async def step(
        self, name: str, fn: Callable[[], Awaitable[T]], *, occurrence: int = 0
    ) -> T: ...

    @overload
    async def step(self, name: str, fn: Callable[[], T], *, occurrence: int = 0) -> T: ...

    async def step(self, name: str, fn: Callable[[], Any], *, occurrence: int = 0) -> Any:
        """Run ``fn`` (a function or coroutine function of no arguments) once per task.

        ``fn`` runs on the worker's event loop: it must not block (make it async for I/O).

        Its result must be JSON (at most 1 MiB); it is stored under (handler version,
        ``name``, ``occurrence``) in a write fenced by this attempt's lease, and the value
        returned is the stored one, as JSON reads it back (a tuple comes back as a list). A
        replay returns it without calling ``fn``. If ``fn`` raises, nothing is stored.

        :raises PayloadError: the result is not JSON or too large; nothing is stored.
        :raises InvalidOptionError: the same name and occurrence were used before in this run.
        """
        runtime = self._runtime()
        key = runtime.key(name, occurrence)
        if not callable(fn):
            raise _not_callable(fn)
        found, value = await runtime.replayed(key, "step")
        if found:
            return value
        result = (  # with OpenTelemetry, in a child span of the attempt's
            telemetry.run_step(self, name, occurrence, fn, wait=True) if telemetry.ENABLED
            else fn()
        )
        if isinstance(result, Awaitable):
            result = await result
        return await runtime.save(key, "step", result)

    def transaction(self, name: str, *, occurrence: int = 0) -> TransactionStep:
        """A session whose writes commit with this step's checkpoint, fenced by the lease.

        ::

            async with ctx.transaction("create-order") as tx_session:
                tx_session.add(order)

        A stale attempt's transaction rolls back as a whole (`LeaseLost`), so the block's
        database writes happen exactly once. See `TransactionStep` for the result and replays.
        """
        runtime = self._runtime()
        return runtime.transaction(runtime.key(name, occurrence))

    async def sleep_for(
        self, name: str, seconds: float | timedelta, *, occurrence: int = 0
    ) -> None:
        """Sleep ``seconds`` of database time without holding a worker slot.

        The wake time is computed by PostgreSQL and stored; the attempt ends (`Suspended`
        unwinds the handler) and the task is pending again at the wake time. On replay an
        elapsed sleep returns at once; one whose stored wake time is still ahead (a retried
        task) sleeps until that time again.
        """
        runtime = self._runtime()
        await runtime.sleep(runtime.key(name, occurrence), delay=seconds, wake_at=None)

    async def sleep_until(self, name: str, when: datetime, *, occurrence: int = 0) -> None:
        """Sleep until ``when`` (timezone-aware), compared with database time."""
        runtime = self._runtime()
        await runtime.sleep(runtime.key(name, occurrence), delay=None, wake_at=when)

    async def wait_for_signal(
        self,
        step: str,
        signal: str,
        *,
        occurrence: int = 0,
        signal_occurrence: int = 0,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """The value of signal (``signal``, ``signal_occurrence``) sent to this task.

        Returns at once if the signal already arrived; otherwise the task waits, holding no
        worker slot, until `emit_signal` sends it or ``timeout`` seconds of database time pass
        (then the result is None). ``occurrence`` names this call's checkpoint;
        ``signal_occurrence`` names the event: they are independent.
        """
        runtime = self._runtime()
        key = runtime.key(step, occurrence)
        return await runtime.wait_for_signal(key, signal, signal_occurrence, timeout)

    async def spawn(
        self,
        step: str,
        name: str | TaskTarget,
        payload: Any = None,
        *,
        occurrence: int = 0,
        **options: Any,
    ) -> uuid.UUID:
        """Create a child task once, and return its id (the same id on every replay).

        ``name`` is a task name or a registered `TaskDefinition`. ``options`` are
        `enqueue`'s: ``queue`` (default: the definition's, else this task's queue),
        ``version``, ``run_at``, ``delay``, ``priority``, ``max_attempts``, ``headers``,
        ``timeout`` (the child's time limit per attempt, instead of its handler's),
        ``concurrency_key``, ``concurrency_limit``. The options are checked on every run but
        are not part of the call's identity: a replay returns the child first spawned,
        whatever options the code now passes. A child under the key its parent holds (with a
        limit of 1) never starts while the parent waits for it: give it another key.
        When this task ends, by any path, its unfinished descendants are cancelled.

        :raises InvalidOptionError: an option is unknown or invalid; nothing was written.

        :raises QueueFull: the child's queue is at capacity; nothing was written.
        """
        runtime = self._runtime()
        key = runtime.key(step, occurrence)
        return await runtime.spawn(key, name, payload, options)

    async def wait_for_result(
        self,
        step: str,
        child_id: uuid.UUID | str,
        *,
        occurrence: int = 0,
        timeout: float | timedelta | None = None,
    ) -> ChildResult:
        """Wait, without a worker slot, until a direct child of this task ends.

        On timeout (database time) the result's state is ``"timeout"`` and the child's
        subtree is cancelled (a running task in it by a cancel request).

        :raises InvalidOptionError: ``child_id`` is not a direct child of this task.
        """
        runtime = self._runtime()
        key = runtime.key(step, occurrence)
        return await runtime.wait_for_result(key, child_id, timeout)


@dataclass(eq=False)
class SyncTaskContext(BaseTaskContext):
    """The context of a plain ``def`` handler (run in a thread); its durable calls block.

    They behave exactly as `TaskContext`'s; see there.
    """

    def step(self, name: str, fn: Callable[[], T], *, occurrence: int = 0) -> T:
        """Run ``fn`` once per task and return its stored JSON value (see `TaskContext.step`)."""
        runtime = self._runtime()
        key = runtime.key(name, occurrence)
        if not callable(fn):
            raise _not_callable(fn)
        replay = runtime.replayed_now(key, "step")
        found, value = replay if replay is not None else runtime.call(
            runtime.replayed(key, "step")
        )
        if found:
            return value  # type: ignore[no-any-return]
        result = (  # with OpenTelemetry, in a child span of the attempt's
            telemetry.run_step(self, name, occurrence, fn, wait=False) if telemetry.ENABLED
            else fn()
        )
        if isinstance(result, Awaitable):
            raise TypeError(
                f"step {name!r}: fn returned an awaitable; a def handler's steps run plain "
                "functions (use an async def handler for coroutines)"
            )
        return runtime.call(runtime.save(key, "step", result))  # type: ignore[no-any-return]

    def transaction(self, name: str, *, occurrence: int = 0) -> SyncTransactionStep:
        """A `Session` whose writes commit with this step's checkpoint, fenced by the lease."""
        runtime = self._runtime()
        return runtime.sync_transaction(runtime.key(name, occurrence))

    def sleep_for(self, name: str, seconds: float | timedelta, *, occurrence: int = 0) -> None:
        """See `TaskContext.sleep_for`."""
        runtime = self._runtime()
        key = runtime.key(name, occurrence)
        runtime.call(runtime.sleep(key, delay=seconds, wake_at=None))

    def sleep_until(self, name: str, when: datetime, *, occurrence: int = 0) -> None:
        """See `TaskContext.sleep_until`."""
        runtime = self._runtime()
        key = runtime.key(name, occurrence)
        runtime.call(runtime.sleep(key, delay=None, wake_at=when))

    def wait_for_signal(
        self,
        step: str,
        signal: str,
        *,
        occurrence: int = 0,
        signal_occurrence: int = 0,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """See `TaskContext.wait_for_signal`."""
        runtime = self._runtime()
        key = runtime.key(step, occurrence)
        return runtime.call(runtime.wait_for_signal(key, signal, signal_occurrence, timeout))

    def spawn(
        self,
        step: str,
        name: str | TaskTarget,
        payload: Any = None,
        *,
        occurrence: int = 0,
        **options: Any,
    ) -> uuid.UUID:
        """See `TaskContext.spawn`."""
        runtime = self._runtime()
        key = runtime.key(step, occurrence)
        return runtime.call(runtime.spawn(key, name, payload, options))

    def wait_for_result(
        self,
        step: str,
        child_id: uuid.UUID | str,
        *,
        occurrence: int = 0,
        timeout: float | timedelta | None = None,
    ) -> ChildResult:
        """See `TaskContext.wait_for_result`."""
        runtime = self._runtime()
        key = runtime.key(step, occurrence)
        return runtime.call(runtime.wait_for_result(key, child_id, timeout))


def _occurrence(header: object) -> tuple[str | None, datetime | None]:
    """(schedule, occurrence) from `SCHEDULE_HEADER`'s value; (None, None) for one that the
    materialiser did not write (only raw SQL can), which must not stop the task."""
    if isinstance(header, dict):
        name, when = header.get("name"), header.get("scheduled_for")
        if isinstance(name, str) and isinstance(when, str):
            with contextlib.suppress(ValueError):
                instant = datetime.fromisoformat(when)
                if instant.tzinfo is not None:
                    return name, instant.astimezone(timezone.utc)
    return None, None


def _not_callable(fn: object) -> TypeError:
    return TypeError(f"fn must be a callable of no arguments, got {type(fn).__name__}")
