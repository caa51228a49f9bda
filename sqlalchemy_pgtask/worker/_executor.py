"""worker._executor: runs handlers and turns what they did into an outcome for the completer.

``async def`` handlers run on the event loop; plain ``def`` handlers run in daemon threads
(a handler that ignores its stop request must not keep the process alive after its task was
handed back). A handler is stopped by cancelling its coroutine; a synchronous one can only be
asked (``ctx.cancelled``), and whatever it does afterwards is fenced out by its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from sqlalchemy import Row

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.control import TaskCancelled
from sqlalchemy_pgtask.durable.context import StopReason, SyncTaskContext, TaskContext
from sqlalchemy_pgtask.outcome import Outcome, decide, one_line
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.statements import Lease
from sqlalchemy_pgtask.worker._attempts import ActiveAttempt, AttemptBook
from sqlalchemy_pgtask.worker._durable import DurableAttempt
from sqlalchemy_pgtask.worker._durable_calls import DurableCalls
from sqlalchemy_pgtask.worker._stuck import STUCK_FRACTION, OnStuckHandler, StuckHandlers

__all__ = ["Executor", "HandlerThreads", "OutcomeSink"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

_Job = tuple[Callable[[], Any], "asyncio.Future[tuple[bool, Any]]", asyncio.AbstractEventLoop]


class HandlerThreads:
    """Daemon threads for synchronous handlers, started on demand.

    A thread whose handler the worker stopped waiting for (at shutdown, or when its lease
    could not be renewed) keeps running until the handler returns; a new one is started for
    the next handler instead of queueing behind it.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, job: Callable[[], Any]) -> asyncio.Future[tuple[bool, Any]]:
        """Run ``job`` in a thread; the future gives ``(True, value)`` or ``(False, exc)``.

        The exception travels inside the result: a future cannot carry a `CancelledError`
        that the handler raised itself without looking cancelled.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        with self._lock:
            if self._idle == 0:
                thread = threading.Thread(
                    target=self._serve, name=f"pgtask-handler-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                self._idle += 1
                thread.start()
            self._idle -= 1
        self._jobs.put((job, future, loop))
        return future

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future, loop = item
            try:
                settled: tuple[bool, Any] = (True, job())
            except BaseException as exc:  # handed to the event loop, which decides
                settled = (False, exc)
            with self._lock:
                self._idle += 1

            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_deliver, future, settled)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _deliver(future: asyncio.Future[tuple[bool, Any]], result: tuple[bool, Any]) -> None:
    if not future.done():  # the worker may have stopped waiting
        future.set_result(result)


#: The claim's columns, by position (the claim returns these, then its two computed ones).
_pick_claimed: Final = operator.itemgetter(*(
    statements.CLAIMED_COLUMNS.index(column) for column in (
        "id", "queue", "name", "version", "payload", "headers", "attempt", "failed_attempts",
        "max_attempts", "lease_token", "retry_kind", "retry_base_seconds", "retry_factor",
        "retry_max_seconds", "retry_jitter",
    )
))


class OutcomeSink(Protocol):
    def submit(self, attempt: ActiveAttempt, outcome: Outcome) -> None: ...


def _extra(attempt: ActiveAttempt, **more: object) -> dict[str, object]:
    ctx = attempt.ctx
    return {
        "task_id": str(ctx.task_id), "task_name": ctx.name, "version": ctx.version,
        "queue": ctx.queue, "attempt": ctx.attempt, "worker_id": str(ctx.worker_id), **more,
    }


class Executor:
    """Starts a handler for each claimed row and hands its outcome to the completer."""

    def __init__(
        self,
        *,
        registry: Registry,
        book: AttemptBook,
        sink: OutcomeSink,
        worker_id: Any,
        lease_seconds: float,
        durable: DurableCalls,
        on_stuck: OnStuckHandler = "warn",
    ) -> None:
        self.stuck = StuckHandlers(on_stuck)
        #: Set once a synchronous handler's thread returned, by attempt.
        self._thread_done: dict[ActiveAttempt, threading.Event] = {}
        self._registry = registry
        self._durable = durable
        self._lease = lease_seconds
        self._book = book
        self._sink = sink
        self._worker_id = worker_id
        self._threads = HandlerThreads()
        #: Every handler coroutine not yet ended, suspended ones still unwinding included
        #: (they left the book's active attempts when their lease went).
        self._handles: set[asyncio.Task[None]] = set()

    def start(self, row: Row[Any], sent: float, *, waited: float = 0.0) -> None:
        """Run the handler of claimed ``row`` (claim sent at monotonic ``sent``; it then
        waited ``waited`` seconds for a slot)."""
        attempt = self._attempt(row, sent)
        ctx = attempt.ctx
        loop = asyncio.get_running_loop()
        ctx._durable = DurableAttempt(self._durable, attempt, loop)
        self._book.add(attempt)
        if row.time_limit is not None:
            # The claim set the deadline at database time + the limit; the row arrived after
            # that, so a local timer of the same length (less the wait for a slot) never
            # fires early.
            attempt.timer = loop.call_later(
                max(0.0, row.time_limit - waited), self._time_out, attempt
            )
        if row.cancel_requested_at is not None:
            ctx.request_stop("cancelled")
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "task %s %s v%d attempt %d started", ctx.task_id, ctx.name, ctx.version,
                ctx.attempt, extra=_extra(attempt),
            )
        # One name for all: formatting the task id costs ~1 us per task (ctx has the id).
        handle = loop.create_task(self._execute(attempt), name="pgtask-handler")
        attempt.handle = handle
        self._handles.add(handle)
        handle.add_done_callback(functools.partial(self._ended, attempt))

    def _ended(self, attempt: ActiveAttempt, handle: asyncio.Task[None]) -> None:
        self._handles.discard(handle)
        if handle.cancelled() and not attempt.settled:
            # Stopped in the turn it was started (the watchdog, after a claim that came back
            # late): a task cancelled before its first step never runs its coroutine, whose
            # own finish would have freed the slot and handed the task back. Without this
            # the slot stayed taken and the lease was renewed for ever.
            self._finish(attempt, None, asyncio.CancelledError())

    def hand_back(self, row: Row[Any], sent: float) -> None:
        """Release claimed ``row`` without running it (through the outcome writer, whose
        lease re-reads and retries every outcome gets; its lease is renewed meanwhile)."""
        attempt = self._attempt(row, sent)
        self._book.hold(attempt)
        self._sink.submit(attempt, Outcome("release"))

    def _attempt(self, row: Row[Any], sent: float) -> ActiveAttempt:
        # One positional pick, not a dozen attribute lookups (~0.3 us each), per claimed row.
        (
            task_id, queue, name, version, payload, headers, attempt, failed_attempts,
            max_attempts, lease_token, kind, base_seconds, factor, max_seconds, jitter,
        ) = _pick_claimed(row)
        definition = self._registry.get(queue, name, version)
        assert definition is not None, "claims are filtered by this registry's capabilities"
        context = TaskContext if definition.is_async else SyncTaskContext
        ctx = context(
            task_id=task_id,
            name=name,
            version=version,
            queue=queue,
            attempt=attempt,
            failed_attempts=failed_attempts,
            max_attempts=max_attempts,
            headers=dict(headers or {}),
            worker_id=self._worker_id,
        )
        policy = RetryPolicy.stored(kind, base_seconds, factor, max_seconds, jitter)
        return ActiveAttempt(
            ctx=ctx,
            definition=definition,
            payload=payload,
            lease=Lease(task_id, attempt, lease_token),
            policy=policy or definition.retry,
            lease_sent_at=sent,
        )

    async def _execute(self, attempt: ActiveAttempt) -> None:
        ctx, definition = attempt.ctx, attempt.definition
        self._book.observer.attempt_started(attempt)
        returned: object = None
        raised: BaseException | None = None
        try:
            if ctx.cancelled:
                raise TaskCancelled(f"task {ctx.task_id} was cancelled")
            if definition.is_async:
                returned = await definition.handler(ctx, attempt.payload)
            else:
                # In this task's context (as asyncio.to_thread does): its trace span included.
                call = functools.partial(
                    contextvars.copy_context().run, definition.handler, ctx, attempt.payload
                )
                done = self._thread_done[attempt] = threading.Event()

                def job() -> Any:
                    try:
                        return call()
                    finally:
                        done.set()

                ok, value = await self._threads.run(job)
                if not ok:
                    raise value
                returned = value
                if inspect.isawaitable(returned):  # a plain function that returned a coroutine
                    returned = await returned
        except BaseException as exc:  # every way a handler can end is an outcome
            raised = exc
        self._finish(attempt, returned, raised)

    def _finish(
        self, attempt: ActiveAttempt, returned: object, raised: BaseException | None
    ) -> None:
        """Decide the attempt's outcome and hand it to the writer; free its slot."""
        ctx, definition = attempt.ctx, attempt.definition
        outcome: Outcome | None = None
        done = self._thread_done.pop(attempt, None)
        try:
            if attempt.suspended:
                pass  # its durable call released the lease; nothing more to write
            elif (
                not definition.is_async
                and attempt.stopped_by_worker
                and isinstance(raised, asyncio.CancelledError)
                and ctx.stop_reason != "timeout"
            ):
                # The worker stopped waiting, but the handler's thread runs on. Handed back
                # at once, another worker could start the task while this thread still runs
                # it; so it runs again no sooner than its lease could have expired (no
                # failure is counted, as for any release).
                outcome = Outcome("release", delay=self._lease)
                logger.warning(
                    "task %s attempt %d: its synchronous handler ignored the stop request; "
                    "handed back to run again in %.1fs", ctx.task_id, ctx.attempt, self._lease,
                )
                if done is not None:  # still running when the lease can expire: stuck
                    due = attempt.lease_sent_at + self._lease * STUCK_FRACTION - time.monotonic()
                    asyncio.get_running_loop().call_later(
                        max(0.0, due), self.stuck.report, attempt, done
                    )
            else:
                outcome = decide(
                    returned=returned,
                    raised=raised,
                    stop=ctx.stop_reason,
                    stopped_by_worker=attempt.stopped_by_worker,
                    policy=attempt.policy,
                    failed_attempts=ctx.failed_attempts,
                    non_retryable=definition.non_retryable,
                )
                if (
                    outcome is not None
                    and outcome.delay is not None
                    and ctx.stop_reason == "timeout"
                    and not definition.is_async
                ):
                    # Its thread may still run: the retry starts no sooner than a lease.
                    outcome = dataclasses.replace(outcome, delay=max(outcome.delay, self._lease))
                self._log_end(attempt, outcome, raised)
        finally:  # whatever happens here, the slot is freed and the attempt settled
            self._book.settle(attempt)
            if outcome is None:
                self._book.forget(attempt)
            else:
                self._sink.submit(attempt, outcome)
            self._book.observer.attempt_finished(attempt, outcome, raised)

    def _log_end(
        self, attempt: ActiveAttempt, outcome: Outcome | None, raised: BaseException | None
    ) -> None:
        duration = time.monotonic() - attempt.started_at
        ctx = attempt.ctx
        if outcome is None:
            logger.warning(
                "task %s attempt %d lost its lease after %.3fs; nothing recorded",
                ctx.task_id, ctx.attempt, duration,
                extra=_extra(attempt, duration_seconds=duration, outcome="lease_lost"),
            )
        elif ctx.stop_reason == "cancelled" and outcome.kind != "release":
            logger.info(
                "task %s %s attempt %d ended after %.3fs, its cancellation requested; stored"
                " as cancelled", ctx.task_id, ctx.name, ctx.attempt, duration,
                extra=_extra(attempt, duration_seconds=duration, outcome="cancelled"),
            )
        elif outcome.kind == "complete":
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "task %s %s attempt %d succeeded in %.3fs", ctx.task_id, ctx.name,
                    ctx.attempt, duration,
                    extra=_extra(attempt, duration_seconds=duration, outcome="succeeded"),
                )
        elif outcome.kind == "release":
            logger.info(
                "task %s attempt %d stopped after %.3fs (%s); handing it back", ctx.task_id,
                ctx.attempt, duration, ctx.stop_reason,
                extra=_extra(attempt, duration_seconds=duration, outcome="released"),
            )
        else:
            # The write retries only while failed attempts remain (the statement decides the
            # same way): say what will happen, not what the policy alone would do.
            budget_left = ctx.max_attempts is None or ctx.failed_attempts + 1 < ctx.max_attempts
            retrying = outcome.delay is not None and budget_left
            if retrying:
                retry = f"; retry in {outcome.delay:.2f}s"
            elif outcome.delay is not None:
                retry = "; no attempts left"
            else:
                retry = ""
            message = "" if raised is None else f": {one_line(raised)}"
            logger.warning(
                "task %s %s attempt %d failed after %.3fs (%s%s)%s", ctx.task_id, ctx.name,
                ctx.attempt, duration, outcome.error_kind, message, retry,
                extra=_extra(
                    attempt, duration_seconds=duration, error_kind=outcome.error_kind,
                    outcome="retrying" if retrying else "failed",
                ),
            )

    def _time_out(self, attempt: ActiveAttempt) -> None:
        if not attempt.settled:
            logger.warning(
                "task %s attempt %d ran past its time limit; stopping it",
                attempt.task_id, attempt.lease.attempt, extra=_extra(attempt),
            )
            self.stop(attempt, "timeout", force=True)

    def stop(self, attempt: ActiveAttempt, reason: StopReason, *, force: bool = False) -> None:
        """Ask a handler to stop. Async handlers are cancelled; sync ones see ``ctx.cancelled``.

        ``force`` also stops waiting for a synchronous handler's thread, so its task can be
        handed back now; whatever the thread does later is fenced out.
        """
        first = attempt.ctx.request_stop(reason)
        if attempt.handle is None or attempt.settled or attempt.handle.done():
            return
        if not attempt.definition.is_async and reason != "cancelled":
            # Its durable call in flight (on a connection that may answer nothing) fails now,
            # and raises LeaseLost in the handler's thread: the thread cannot be cancelled.
            self._durable.sever_for(attempt.ctx._durable)
        if (attempt.definition.is_async and first) or force:
            attempt.stopped_by_worker = True
            attempt.handle.cancel()

    def handles(self) -> list[asyncio.Task[None]]:
        return list(self._handles)

    def close(self) -> None:
        self._threads.close()
