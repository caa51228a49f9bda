"""worker: the asyncio runtime that claims tasks, runs handlers and records their outcomes.

One `Worker` runs these loops concurrently, each reconnecting on its own with bounded
exponential backoff and jitter, so a failure in one never blocks the others:

* **listener**: one autocommit connection that ``LISTEN``s on ``pgtask_ready``; a notification
  (or a reconnect) wakes the claim loop. Notifications are hints only.
* **claim loop**: claims up to the free slots with one statement per queue and starts the
  handlers. The claim commits before any handler code runs. When nothing is due it sleeps until
  the earliest of a notification, the database-derived next ``run_at`` and the poll interval.
* **writer**: records outcomes (success, failure, release) in batches, one fenced statement per
  kind. A slot is freed only once its outcome is written, which is the claim loop's
  back-pressure.
* **renewer**: extends every active lease with one statement every lease/3; a lease it cannot
  extend is lost, and its handler is stopped. If renewal keeps failing, handlers are stopped
  before their lease could expire.
* **recovery**: returns tasks whose lease expired (their worker died) to pending, in bounded
  batches.
* **heartbeat**: keeps this worker's row, its capabilities and its draining flag current.

Deadlines are always computed by PostgreSQL; this process's clock only measures its own
intervals (monotonic), never a stored timestamp.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import psycopg
from sqlalchemy import func, make_url, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask.client import listen_conninfo
from sqlalchemy_pgtask.context import StopReason, TaskContext
from sqlalchemy_pgtask.control import Fail, LeaseLost, Retry, TaskCancelled
from sqlalchemy_pgtask.errors import InvalidOptionError, PolicyConflict, SchemaNotInstalled
from sqlalchemy_pgtask.outcome import error_document, result_document
from sqlalchemy_pgtask.registry import Registry, TaskDefinition
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.validation import check_queue_name

__all__ = ["Worker", "WorkerOptions"]

logger = logging.getLogger(__name__)

READY_CHANNEL: Final = "pgtask_ready"
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """How a `Worker` runs. Durations are in seconds."""

    #: Queues to serve, in priority order (earlier queues are drained first). Default: every
    #: queue that has a handler in the registry.
    queues: tuple[str, ...] | None = None
    #: Most handlers running at once.
    concurrency: int = 10
    #: How long a claim is valid without renewal; renewed every third of it.
    lease_duration: float = 30.0
    #: After a shutdown request, how long running handlers may finish before they are stopped
    #: and their tasks handed back.
    shutdown_grace: float = 30.0
    #: The longest an idle worker sleeps before it looks for work without a notification.
    poll_interval: float = 30.0
    #: How often this worker reports that it is alive; it is considered gone after the TTL.
    heartbeat_interval: float = 10.0
    worker_ttl: float = 30.0
    #: Expired leases recovered per statement (up to 16 statements per pass).
    recovery_batch_size: int = 100
    #: Most outcomes written by one statement.
    write_batch_size: int = 500

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or (
            self.concurrency < 1
        ):
            raise InvalidOptionError("concurrency", "must be a positive int")
        for name in ("lease_duration", "poll_interval", "heartbeat_interval", "worker_ttl"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise InvalidOptionError(name, f"must be a positive number, got {value!r}")
        if self.lease_duration < 0.3:
            raise InvalidOptionError("lease_duration", "must be at least 0.3 seconds")
        if not self.shutdown_grace >= 0:
            raise InvalidOptionError("shutdown_grace", "must not be negative")
        if self.heartbeat_interval >= self.worker_ttl:
            raise InvalidOptionError("heartbeat_interval", "must be shorter than worker_ttl")
        for name in ("recovery_batch_size", "write_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(name, "must be a positive int")
        if self.queues is not None:
            if not self.queues:
                raise InvalidOptionError("queues", "must not be empty")
            for q in self.queues:
                check_queue_name(q, "queues")
            if len(set(self.queues)) != len(self.queues):
                raise InvalidOptionError("queues", "must not repeat a queue")


class _Backoff:
    """Bounded exponential backoff with full jitter, so reconnecting workers spread out."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self._base = base
        self._cap = cap
        self._failures = 0

    def reset(self) -> None:
        self._failures = 0

    def next(self) -> float:
        ceiling = min(self._cap, self._base * 2**self._failures)
        self._failures = min(self._failures + 1, 32)
        return random.uniform(ceiling / 2, ceiling)  # noqa: S311 - spread, not secrecy


def _brief(exc: BaseException) -> str:
    """One line about a failure, without the statement and its parameters (task data)."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def _is_transient(exc: BaseException) -> bool:
    """A lost or refused connection: retry after backoff; the transaction outcome is unknown."""
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(
            exc.orig, (psycopg.OperationalError, psycopg.InterfaceError)
        )
    return isinstance(
        exc,
        (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout, OSError),
    )


class _HandlerThreads:
    """Daemon threads for synchronous handlers.

    Daemon threads because a handler that ignores its stop request must not keep the process
    alive after the worker handed its task back.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop] | None
        ] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def run(self, job: Callable[[], _T]) -> asyncio.Future[_T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        if not self._threads:
            for index in range(self._size):
                thread = threading.Thread(
                    target=self._serve, name=f"pgtask-handler-{index}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        self._jobs.put((job, future, loop))
        return future

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future, loop = item
            try:
                value = job()
            except BaseException as exc:  # handed to the event loop, which decides
                self._deliver(loop, future, exc, error=True)
            else:
                self._deliver(loop, future, value, error=False)

    @staticmethod
    def _deliver(
        loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any, *, error: bool
    ) -> None:
        def settle() -> None:
            if future.done():  # the worker stopped waiting (shutdown)
                return
            if error:
                future.set_exception(value)
            else:
                future.set_result(value)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(settle)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


#: Planner settings for the connections that run the hot statements. Every one of them is
#: meant to probe an index; a plan cached while a table was nearly empty (a new install, or
#: right after a big cleanup) would otherwise keep scanning it sequentially as it grows.
_PLANNER_SETTINGS: Final = (("enable_seqscan", "off"), ("plan_cache_mode", "force_generic_plan"))


class _HeldConnection:
    """One autocommit connection kept across statements, replaced after any error."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._connection: AsyncConnection | None = None

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[AsyncConnection]:
        if self._connection is None:
            connection = await self._engine.connect()
            for name, value in _PLANNER_SETTINGS:
                await connection.execute(
                    select(func.set_config(name, value, False))  # session-wide
                )
            self._connection = connection
        try:
            yield self._connection
        except BaseException:
            # Its state is unknown (broken, or mid-statement when cancelled): start afresh.
            await self.close()
            raise

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                # The connection goes back to a pool the application may share.
                for name, _ in _PLANNER_SETTINGS:
                    await connection.execute(text(f"RESET {name}"))
            with contextlib.suppress(Exception):
                await connection.close()


@dataclass(eq=False)
class _Running:
    """One claimed attempt, from claim until its outcome is written."""

    ctx: TaskContext
    definition: TaskDefinition[Any, Any]
    payload: Any
    lease_token: uuid.UUID
    policy: RetryPolicy
    #: Monotonic time the last claim or renewal that held this lease was sent.
    lease_sent_at: float
    handle: asyncio.Task[None] | None = None
    #: Its outcome is queued or being written: renewal must not call it lost any more.
    settled: bool = False

    @property
    def task_id(self) -> uuid.UUID:
        return self.ctx.task_id

    @property
    def attempt(self) -> int:
        return self.ctx.attempt


_OutcomeKind = Literal["complete", "fail", "release"]


@dataclass(eq=False)
class _Outcome:
    running: _Running
    kind: _OutcomeKind
    document: str | None = None
    delay: float | None = None


def _policy(row: Any, fallback: RetryPolicy) -> RetryPolicy:
    if row.retry_kind is None:
        return fallback
    return RetryPolicy(
        row.retry_kind,
        base_seconds=row.retry_base_seconds,
        factor=row.retry_factor,
        max_seconds=row.retry_max_seconds,
        jitter=bool(row.retry_jitter),
    )


def _identity_arrays(definitions: Sequence[TaskDefinition[Any, Any]]) -> dict[str, list[Any]]:
    """Handler identities and their retry policies as the parallel arrays statements take."""
    return {
        "queues": [d.queue for d in definitions],
        "names": [d.name for d in definitions],
        "versions": [d.version for d in definitions],
        "retry_kinds": [d.retry.kind for d in definitions],
        "retry_bases": [d.retry.base_seconds for d in definitions],
        "retry_factors": [d.retry.factor for d in definitions],
        "retry_maxes": [d.retry.max_seconds for d in definitions],
        "retry_jitters": [d.retry.jitter for d in definitions],
    }


class Worker:
    """Runs the handlers of a `Registry` against one PostgreSQL database.

    ::

        worker = Worker(registry, "postgresql+psycopg://app@db/app")
        await worker.run()  # until worker.shutdown() or a signal handled by the caller

    ``pgtask worker module:registry`` wraps this with signal handling.
    """

    def __init__(
        self,
        registry: Registry,
        database: str | AsyncEngine,
        options: WorkerOptions | None = None,
    ) -> None:
        if not len(registry):
            raise InvalidOptionError("registry", "has no handlers")
        self.options = options or WorkerOptions()
        self.registry = registry
        self.id = uuid.uuid4()
        self.queues: tuple[str, ...] = self.options.queues or tuple(registry.queues)
        served = [d for d in registry if d.queue in self.queues]
        if not served:
            raise InvalidOptionError("queues", f"no handler is registered on {self.queues}")
        if isinstance(database, AsyncEngine):
            self._engine = database
            self._owns_engine = False
        else:
            self._engine = create_async_engine(
                make_url(database).set(drivername="postgresql+psycopg"),
                pool_size=6,
                max_overflow=4,
                # Errors are logged; statement parameters carry task payloads and results.
                hide_parameters=True,
            )
            self._owns_engine = True
        # Every worker statement is a single statement: autocommit spares BEGIN/COMMIT trips.
        self._auto = self._engine.execution_options(isolation_level="AUTOCOMMIT")
        self._listen_url = listen_conninfo(self._engine.url)
        self._claim_params = {q: self._claim_parameters(q) for q in self.queues}
        self._lease = float(self.options.lease_duration)
        self._active: dict[uuid.UUID, _Running] = {}
        #: Claimed attempts whose handler has not finished (the slots in use).
        self._unsettled = 0
        # The hot path keeps its two connections: a pool checkout per statement costs more
        # than the statement's own round trip. Claims and writes overlap on them.
        self._claim_connection = _HeldConnection(self._auto)
        self._write_connection = _HeldConnection(self._auto)
        self._outcomes: asyncio.Queue[_Outcome] | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._immediate = asyncio.Event()
        self._listening = asyncio.Event()
        self._ready = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._threads = _HandlerThreads(self.options.concurrency)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False

    # -- public control ------------------------------------------------------------------

    def shutdown(self, *, immediate: bool = False) -> None:
        """Stop claiming and drain; a second call (or ``immediate``) stops at once.

        Safe to call from any thread and from signal handlers.
        """
        loop = self._loop

        def request() -> None:
            if immediate or self._stopping.is_set():
                self._immediate.set()
            self._stopping.set()
            self._wake.set()

        # Before run() there is no loop yet: the flags make run() return right after startup.
        if loop is None or _running_loop() is loop:
            request()
        else:
            loop.call_soon_threadsafe(request)

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        """Return once the worker listens, is registered and its loops run."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def active_count(self) -> int:
        """Attempts claimed and not yet recorded (at most twice the concurrency)."""
        return len(self._active)

    @property
    def running_count(self) -> int:
        """Handlers running now (at most the concurrency)."""
        return self._unsettled

    # -- main ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until `shutdown`; then drain, hand back what is left, and return."""
        self._loop = asyncio.get_running_loop()
        self._outcomes = asyncio.Queue()
        loops: list[asyncio.Task[None]] = []
        try:
            await self._check_schema()
            loops.append(asyncio.create_task(self._listen(), name="pgtask-listener"))
            await self._wait_listening()
            await self._register()
            loops += [
                asyncio.create_task(self._write_loop(), name="pgtask-writer"),
                asyncio.create_task(self._renew_loop(), name="pgtask-renewer"),
                asyncio.create_task(self._recovery_loop(), name="pgtask-recovery"),
                asyncio.create_task(self._heartbeat_loop(), name="pgtask-heartbeat"),
            ]
            claim = asyncio.create_task(self._claim_loop(), name="pgtask-claim")
            self._ready.set()
            logger.info(
                "worker %s serving %s with concurrency %d",
                self.id, ", ".join(self.queues), self.options.concurrency,
            )
            await self._stopping.wait()
            await self._drain(claim)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._claim_connection.close()
            await self._write_connection.close()
            await self._unregister()
            self._threads.close()
            if self._owns_engine:
                await self._engine.dispose()

    async def _check_schema(self) -> None:
        async with self._auto.connect() as conn:
            installed = (await conn.execute(statements.SCHEMA_INSTALLED)).scalar_one()
        if not installed:
            raise SchemaNotInstalled()

    async def _wait_listening(self) -> None:
        listening = asyncio.create_task(self._listening.wait())
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({listening, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            stopping.cancel()

    async def _drain(self, claim: asyncio.Task[None]) -> None:
        """Graceful shutdown: no new claims, handlers get the grace period, then hand back."""
        self.draining = True
        self._wake.set()
        await asyncio.gather(claim, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._heartbeat()  # visible as draining at once, not at the end
        deadline = time.monotonic() + self.options.shutdown_grace
        while self._active and not self._immediate.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._slot_freed.clear()
            await _first(self._slot_freed.wait(), self._immediate.wait(), timeout=remaining)
        leftovers = [r for r in self._active.values() if not r.settled]
        if leftovers:
            logger.warning("handing back %d unfinished task(s)", len(leftovers))
        for running in leftovers:
            self._stop(running, "shutdown", force=True)
        # Releases and last outcomes are written by the writer; give it a bounded moment.
        release_deadline = time.monotonic() + 5.0
        while self._active and time.monotonic() < release_deadline:
            self._slot_freed.clear()
            await _first(
                self._slot_freed.wait(), timeout=max(0.0, release_deadline - time.monotonic())
            )

    # -- listener ------------------------------------------------------------------------

    async def _listen(self) -> None:
        backoff = _Backoff()
        queues = set(self.queues)
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self._listen_url, autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {READY_CHANNEL}")
                    backoff.reset()
                    self._listening.set()
                    self._wake.set()  # anything enqueued while we were deaf is due now
                    async for notification in conn.notifies():
                        if notification.payload in queues:
                            self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not _is_transient(exc):
                    logger.exception("listener failed")
                delay = backoff.next()
                logger.warning(
                    "listener disconnected (%s); reconnecting in %.2fs", _brief(exc), delay
                )
                await asyncio.sleep(delay)

    # -- claim ---------------------------------------------------------------------------

    def _claim_parameters(self, queue_name: str) -> dict[str, Any]:
        identities = _identity_arrays(self.registry.for_queue(queue_name))
        del identities["queues"]  # a claim serves one queue: "claim_queue"
        return {
            "claim_queue": queue_name,
            "worker_id": self.id,
            "lease_seconds": float(self.options.lease_duration),
            **identities,
        }

    async def _claim_loop(self) -> None:
        backoff = _Backoff(cap=5.0)
        concurrency = self.options.concurrency
        while not self._stopping.is_set():
            self._wake.clear()
            # Running handlers never exceed the concurrency. Finished ones whose outcome still
            # waits for the writer do not hold a slot, so claims overlap writes; but at most
            # `concurrency` of them may wait, which is the back-pressure on a slow writer.
            free = min(
                concurrency - self._unsettled, 2 * concurrency - len(self._active)
            )
            if free <= 0:
                await self._wake.wait()
                continue
            try:
                claimed = await self._claim(free)
                timeout = None
                if claimed < free:
                    await asyncio.sleep(0)  # let the new handlers start before asking
                    timeout = await self._idle_timeout()
                backoff.reset()
            except Exception as exc:
                if not _is_transient(exc):
                    logger.exception("claim failed")
                timeout = backoff.next()
                logger.warning("claim failed (%s); retrying in %.2fs", _brief(exc), timeout)
                await _first(self._stopping.wait(), timeout=timeout)
                continue
            if claimed == free:
                continue  # the slots are full; loop to wait for one to free
            await _first(self._wake.wait(), timeout=timeout)

    async def _claim(self, free: int) -> int:
        claimed = 0
        async with self._claim_connection.use() as conn:
            for queue_name in self.queues:
                limit = free - claimed
                if limit <= 0:
                    break
                params = dict(self._claim_params[queue_name], limit=limit)
                sent = time.monotonic()
                rows = (await conn.execute(statements.CLAIM, params)).all()
                for row in rows:
                    self._start(row, sent)
                claimed += len(rows)
        return claimed

    async def _idle_timeout(self) -> float:
        async with self._auto.connect() as conn:
            seconds = (
                await conn.execute(statements.SECONDS_UNTIL_DUE, {"queues": list(self.queues)})
            ).scalar_one()
        poll = float(self.options.poll_interval)
        if seconds is None:
            return poll
        return max(0.001, min(poll, float(seconds)))

    def _start(self, row: Any, sent: float) -> None:
        definition = self.registry.get(row.queue, row.name, row.version)
        assert definition is not None, "claims are filtered by this registry's capabilities"
        ctx = TaskContext(
            task_id=row.id,
            name=row.name,
            version=row.version,
            queue=row.queue,
            attempt=row.attempt,
            failed_attempts=row.failed_attempts,
            max_attempts=row.max_attempts,
            headers=dict(row.headers or {}),
            worker_id=self.id,
        )
        running = _Running(
            ctx=ctx,
            definition=definition,
            payload=row.payload,
            lease_token=row.lease_token,
            policy=_policy(row, definition.retry),
            lease_sent_at=sent,
        )
        self._active[row.id] = running
        self._unsettled += 1
        if row.cancel_requested_at is not None:
            ctx.request_stop("cancelled")
        running.handle = asyncio.create_task(self._execute(running), name=f"pgtask-{row.id}")

    # -- handler execution ---------------------------------------------------------------

    async def _execute(self, running: _Running) -> None:
        ctx = running.ctx
        definition = running.definition
        try:
            if ctx.cancelled:
                raise TaskCancelled()
            if definition.is_async:
                value = await definition.handler(ctx, running.payload)
            else:
                value = await self._threads.run(lambda: definition.handler(ctx, running.payload))
                if inspect.isawaitable(value):  # a plain function that returned a coroutine
                    value = await value
        except asyncio.CancelledError:
            if ctx.stop_reason is None:
                raise  # the worker itself is being torn down
            self._settle(running, self._stopped(running))
        except (LeaseLost, TaskCancelled) as exc:
            reason: StopReason = ctx.stop_reason or (
                "cancelled" if isinstance(exc, TaskCancelled) else "lease_lost"
            )
            self._settle(running, self._stopped(running, reason))
        except Fail as exc:
            self._settle(running, _Outcome(running, "fail", error_document("fail", exc)))
        except Retry as exc:
            delay = exc.delay
            if delay is None:
                delay = running.policy.delay(ctx.failed_attempts + 1) or 0.0
            self._settle(
                running, _Outcome(running, "fail", error_document("retry", exc), max(0.0, delay))
            )
        except BaseException as exc:  # any handler failure, SystemExit included
            if isinstance(exc, definition.non_retryable):
                self._settle(running, _Outcome(running, "fail", error_document("fail", exc)))
            else:
                delay = running.policy.delay(ctx.failed_attempts + 1)
                document = error_document("handler_error", exc)
                self._settle(running, _Outcome(running, "fail", document, delay))
        else:
            if ctx.stop_reason == "lease_lost":
                self._settle(running, None)
                return
            result, rejected = result_document(value)
            if rejected is not None:
                logger.error("task %s returned a value that cannot be stored", ctx.task_id)
                self._settle(running, _Outcome(running, "fail", rejected))
            else:
                self._settle(running, _Outcome(running, "complete", result))

    def _stopped(self, running: _Running, reason: StopReason | None = None) -> _Outcome | None:
        reason = reason or running.ctx.stop_reason
        if reason == "cancelled":
            return _Outcome(running, "fail", error_document("cancelled"))
        if reason == "shutdown":
            return _Outcome(running, "release")
        return None  # lease lost: this attempt may write nothing

    def _settle(self, running: _Running, outcome: _Outcome | None) -> None:
        running.settled = True
        self._unsettled -= 1
        self._wake.set()  # a handler slot is free
        if outcome is None:
            self._forget(running)
            return
        assert self._outcomes is not None
        self._outcomes.put_nowait(outcome)

    def _forget(self, running: _Running) -> None:
        if self._active.get(running.task_id) is running:
            del self._active[running.task_id]
            self._slot_freed.set()
            self._wake.set()

    def _stop(self, running: _Running, reason: StopReason, *, force: bool = False) -> None:
        """Ask a handler to stop. Async handlers are cancelled; sync ones see ``ctx.cancelled``.

        ``force`` also stops waiting for a synchronous handler's thread, so its task can be
        handed back now; whatever the thread does later is fenced out.
        """
        first = running.ctx.request_stop(reason)
        if running.handle is None or running.settled:
            return
        if (running.definition.is_async and first) or force:
            running.handle.cancel()

    # -- writer --------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        assert self._outcomes is not None
        outcomes = self._outcomes
        limit = self.options.write_batch_size
        while True:
            batch = [await outcomes.get()]
            while len(batch) < limit and not outcomes.empty():
                batch.append(outcomes.get_nowait())
            await self._write(batch)

    async def _write(self, batch: list[_Outcome]) -> None:
        backoff = _Backoff(cap=2.0)
        pending = batch
        while pending:
            try:
                await self._write_batch(pending)
                return
            except Exception as exc:
                if not _is_transient(exc):
                    logger.exception("writing %d outcome(s) failed; one by one now", len(pending))
                    await self._write_one_by_one(pending)
                    return
                delay = backoff.next()
                logger.warning(
                    "writing outcomes failed (%s); retrying in %.2fs", _brief(exc), delay
                )
                await asyncio.sleep(delay)
                # The commit may or may not have happened: re-read before writing again.
                pending = await self._still_owned(pending)

    async def _write_batch(self, batch: Sequence[_Outcome]) -> None:
        by_kind: dict[_OutcomeKind, list[_Outcome]] = {}
        for outcome in batch:
            by_kind.setdefault(outcome.kind, []).append(outcome)
        async with self._write_connection.use() as conn:
            for kind, group in by_kind.items():
                written = await self._execute_outcomes(conn, kind, group)
                for outcome in group:
                    if outcome.running.task_id not in written:
                        logger.info(
                            "task %s attempt %d lost its lease; its %s was not recorded",
                            outcome.running.task_id, outcome.running.attempt, kind,
                        )
                    self._forget(outcome.running)

    async def _execute_outcomes(
        self, conn: AsyncConnection, kind: _OutcomeKind, group: Sequence[_Outcome]
    ) -> set[uuid.UUID]:
        params: dict[str, Any] = {
            "ids": [o.running.task_id for o in group],
            "attempts": [o.running.attempt for o in group],
            "tokens": [o.running.lease_token for o in group],
            "running": "running",
        }
        if kind == "complete":
            statement = statements.COMPLETE
            params["results"] = [o.document for o in group]
        elif kind == "fail":
            statement = statements.FAIL
            params["errors"] = [o.document for o in group]
            params["delays"] = [None if o.delay is None else float(o.delay) for o in group]
        else:
            statement = statements.RELEASE
        rows = (await conn.execute(statement, params)).all()
        return {row.id for row in rows}

    async def _write_one_by_one(self, batch: Sequence[_Outcome]) -> None:
        for outcome in batch:
            try:
                async with self._auto.connect() as conn:
                    await self._execute_outcomes(conn, outcome.kind, [outcome])
            except Exception as exc:
                if _is_transient(exc):
                    logger.warning(
                        "task %s: outcome not written (%s)", outcome.running.task_id, _brief(exc)
                    )
                else:
                    logger.exception("task %s: outcome rejected", outcome.running.task_id)
                    # Never leave a task to retry the same unwritable outcome forever.
                    with contextlib.suppress(Exception):
                        async with self._auto.connect() as conn:
                            fallback = _Outcome(
                                outcome.running, "fail",
                                error_document("outcome_rejected", exc),
                            )
                            await self._execute_outcomes(conn, "fail", [fallback])
            self._forget(outcome.running)

    async def _still_owned(self, batch: list[_Outcome]) -> list[_Outcome]:
        """Keep the outcomes whose attempt still holds its lease (their write did not land)."""
        while True:
            try:
                async with self._auto.connect() as conn:
                    rows = (
                        await conn.execute(
                            statements.LEASES, {"ids": [o.running.task_id for o in batch]}
                        )
                    ).all()
                break
            except Exception as exc:
                if not _is_transient(exc):
                    raise
                await asyncio.sleep(_Backoff().next())
        held = {(r.id, r.attempt, r.lease_token) for r in rows if r.state == "running"}
        keep = []
        for outcome in batch:
            running = outcome.running
            if (running.task_id, running.attempt, running.lease_token) in held:
                keep.append(outcome)
            else:
                self._forget(running)  # written before the connection broke, or lease lost
        return keep

    # -- leases --------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        interval = self._lease / 3
        backoff = _Backoff(base=min(0.1, interval / 4), cap=interval)
        wait = interval
        while True:
            await asyncio.sleep(wait)
            # Settled attempts are renewed too: their outcome may still wait for the writer
            # (a database hiccup), and the lease must outlive that wait.
            entries = list(self._active.values())
            if not entries:
                wait = interval
                continue
            sent = time.monotonic()
            try:
                renewed = await self._renew(entries)
            except Exception as exc:
                if not _is_transient(exc):
                    logger.exception("lease renewal failed")
                self._stop_overdue(sent)
                wait = backoff.next()
                logger.warning("lease renewal failed (%s); retrying in %.2fs", _brief(exc), wait)
                continue
            backoff.reset()
            wait = interval
            for running in entries:
                if running.task_id in renewed:
                    running.lease_sent_at = sent
                    if renewed[running.task_id]:
                        self._stop(running, "cancelled")
                elif not running.settled and self._active.get(running.task_id) is running:
                    logger.warning(
                        "task %s attempt %d lost its lease; stopping its handler",
                        running.task_id, running.attempt,
                    )
                    self._stop(running, "lease_lost")

    async def _renew(self, entries: Sequence[_Running]) -> dict[uuid.UUID, bool]:
        async with self._auto.connect() as conn:
            rows = (
                await conn.execute(
                    statements.RENEW,
                    {
                        "ids": [r.task_id for r in entries],
                        "attempts": [r.attempt for r in entries],
                        "tokens": [r.lease_token for r in entries],
                        "running": "running",
                        "lease_seconds": self._lease,
                    },
                )
            ).all()
        return {row.id: bool(row.cancel) for row in rows}

    def _stop_overdue(self, now: float) -> None:
        """Stop handlers whose lease may expire before renewal can succeed again."""
        for running in list(self._active.values()):
            if not running.settled and now - running.lease_sent_at >= self._lease * 2 / 3:
                logger.warning(
                    "task %s: lease could not be renewed in time; stopping its handler",
                    running.task_id,
                )
                self._stop(running, "lease_lost")

    async def _recovery_loop(self) -> None:
        interval = self._lease / 3
        backoff = _Backoff(cap=interval)
        batch = self.options.recovery_batch_size
        while True:
            try:
                async with self._auto.connect() as conn:
                    for _ in range(16):
                        rows = (await conn.execute(statements.RECOVER, {"limit": batch})).all()
                        if rows:
                            logger.info("recovered %d task(s) with expired leases", len(rows))
                        if len(rows) < batch:
                            break
                backoff.reset()
                wait = interval * random.uniform(0.8, 1.2)  # noqa: S311
            except Exception as exc:
                if not _is_transient(exc):
                    logger.exception("lease recovery failed")
                wait = backoff.next()
            await asyncio.sleep(wait)

    # -- registration --------------------------------------------------------------------

    async def _register(self) -> None:
        from sqlalchemy_pgtask import __version__

        identities = _identity_arrays([d for d in self.registry if d.queue in self.queues])
        async with self._engine.begin() as conn:
            await conn.execute(
                statements.REGISTER_WORKER,
                {
                    "worker_id": self.id,
                    "queues": list(self.queues),
                    "version": __version__,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "concurrency": self.options.concurrency,
                    "draining": False,
                    "ttl_seconds": float(self.options.worker_ttl),
                },
            )
            await conn.execute(statements.CLEAR_CAPABILITIES, {"worker_id": self.id})
            capabilities = {k: identities[k] for k in ("queues", "names", "versions")}
            await conn.execute(
                statements.ADD_CAPABILITIES, {"worker_id": self.id, **capabilities}
            )
            await conn.execute(statements.REGISTER_POLICIES, identities)
            stored = (
                await conn.execute(statements.STORED_POLICIES, {"queues": list(self.queues)})
            ).all()
            frozen = {
                (r.queue, r.name, r.version): RetryPolicy(
                    r.retry_kind, r.retry_base_seconds, r.retry_factor, r.retry_max_seconds,
                    r.retry_jitter,
                )
                for r in stored
            }
            for definition in self.registry:
                key = (definition.queue, definition.name, definition.version)
                if key in frozen and frozen[key] != definition.retry:
                    raise PolicyConflict(
                        f"{definition.name!r} version {definition.version} on queue "
                        f"{definition.queue!r} has the retry policy {frozen[key]} in the "
                        f"database, but this worker registers {definition.retry}; policies "
                        "are immutable, so register the new policy under a new version"
                    )

    async def _heartbeat(self) -> None:
        async with self._auto.connect() as conn:
            alive = (
                await conn.execute(
                    statements.HEARTBEAT,
                    {
                        "worker_id": self.id,
                        "ttl_seconds": float(self.options.worker_ttl),
                        "draining": self.draining,
                    },
                )
            ).first()
        if alive is None and not self.draining:
            logger.warning("worker row %s disappeared; registering again", self.id)
            await self._register()

    async def _heartbeat_loop(self) -> None:
        backoff = _Backoff(cap=self.options.heartbeat_interval)
        while True:
            wait = self.options.heartbeat_interval
            try:
                await self._heartbeat()
                backoff.reset()
            except Exception as exc:
                if not _is_transient(exc):
                    logger.exception("heartbeat failed")
                wait = backoff.next()
            await asyncio.sleep(wait)

    async def _unregister(self) -> None:
        with contextlib.suppress(Exception):
            async with self._auto.connect() as conn:
                await asyncio.wait_for(
                    conn.execute(statements.RETIRE_WORKER, {"worker_id": self.id}), 5.0
                )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _first(*waits: Awaitable[Any], timeout: float | None = None) -> None:
    """Wait until the first of ``waits`` finishes or ``timeout`` passes; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
