"""worker._runtime: the `Worker`; starts, supervises and stops the loops of the other modules.

Startup: check the schema, LISTEN, register (policies frozen or checked), then start the loops:
listener, producer (claims), completer (outcomes), lease renewal and its watchdog, heartbeat,
maintenance. Supervision: a loop is never meant to end, so one that does (it raised something
that is not transient) stops the worker at once: its handlers are stopped, their tasks handed
back, and `run` raises `WorkerCrashed`. Nothing is left running behind, also when `run` itself
is cancelled.

Graceful stop (`shutdown`): stop claiming, mark the worker draining, give running handlers the
grace period (leases are still renewed), then stop what is left and hand it back with a fenced
release that spends no attempt. Every wait of the stop is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Coroutine
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import bounded, first
from sqlalchemy_pgtask._failures import brief
from sqlalchemy_pgtask.errors import InvalidOptionError, WorkerCrashed
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.statements import Capability
from sqlalchemy_pgtask.statements.rescue import LOCK_NAMESPACE
from sqlalchemy_pgtask.worker._attempts import AttemptBook
from sqlalchemy_pgtask.worker._closing import close_within, stop_in_flight
from sqlalchemy_pgtask.worker._completer import Completer
from sqlalchemy_pgtask.worker._deadlines import Liveness, abandon_after, quick_deadline
from sqlalchemy_pgtask.worker._durable_calls import DurableCalls
from sqlalchemy_pgtask.worker._executor import Executor
from sqlalchemy_pgtask.worker._leases import LeaseKeeper
from sqlalchemy_pgtask.worker._listener import Listener
from sqlalchemy_pgtask.worker._maintenance import MaintenanceRunner, WaitTimeouts
from sqlalchemy_pgtask.worker._observer import observe
from sqlalchemy_pgtask.worker._options import WorkerOptions
from sqlalchemy_pgtask.worker._producer import Producer
from sqlalchemy_pgtask.worker._reconnect import HeldConnection, owned_engine
from sqlalchemy_pgtask.worker._registration import Registration
from sqlalchemy_pgtask.worker._services import maintenance_services
from sqlalchemy_pgtask.worker._session import check_database
from sqlalchemy_pgtask.worker._stopped import Stopped
from sqlalchemy_pgtask.worker._transactions import TransactionEngines

__all__ = ["Worker"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: The longest the stop waits for the claim loop's statement in flight, and for the heartbeat
#: that marks the worker draining.
_STEP_TIMEOUT = 5.0


class Worker:
    """Runs the handlers of a `Registry` against one PostgreSQL database.

    ::

        worker = Worker(registry, "postgresql+psycopg://app@db/app")
        await worker.run()  # until worker.shutdown(); `sqlalchemy_pgtask.worker.run` adds signals

    ``database`` is a URL (the worker makes and disposes its own engine) or an `AsyncEngine`
    (shared: the worker holds up to five of its connections while it runs, plus
    ``durable_connections``, plus one per open ``ctx.transaction`` block).
    """

    def __init__(
        self,
        registry: Registry,
        database: str | AsyncEngine,
        options: WorkerOptions | None = None,
    ) -> None:
        if not isinstance(registry, Registry):
            raise InvalidOptionError(
                "registry", f"must be a Registry, got {type(registry).__name__}"
            )
        if not len(registry):
            raise InvalidOptionError("registry", "has no handlers")
        if options is not None and not isinstance(options, WorkerOptions):
            raise InvalidOptionError(
                "options", f"must be a WorkerOptions, got {type(options).__name__}"
            )
        self.options = options or WorkerOptions()
        self.registry = registry
        self.id = uuid.uuid4()
        self.queues: tuple[str, ...] = self.options.queues or tuple(registry.queues)
        served = [d for d in registry if d.queue in self.queues]
        if not served:
            raise InvalidOptionError("queues", f"no handler is registered on {self.queues}")
        if isinstance(database, AsyncEngine):
            if database.dialect.driver != "psycopg":
                raise InvalidOptionError(
                    "database",
                    f"the worker speaks psycopg 3; this engine uses {database.dialect.driver!r}"
                    " (use a postgresql+psycopg:// URL)",
                )
            self._engine = database
            self._owns_engine = False
        else:
            self._engine = owned_engine(database)
            self._owns_engine = True
        options = self.options
        lease = float(options.lease_duration)
        # Every worker statement is a single statement: autocommit spares BEGIN/COMMIT trips.
        auto = self._engine.execution_options(isolation_level="AUTOCOMMIT")

        # Every connection the worker keeps holds this lock: gone with the last of them.
        lock_key = secrets.randbelow(2**31 - 1) + 1 if options.instant_rescue else None
        lock = None if lock_key is None else (LOCK_NAMESPACE, lock_key)

        self.liveness = Liveness()  # the last round trip to PostgreSQL, for /healthz
        quick = quick_deadline(lease, options.statement_timeout)

        def held(deadline: float | None = quick) -> HeldConnection:  # None: a long one
            return HeldConnection(
                auto, lock_timeout=options.effective_lock_timeout, lock=lock,
                statement_timeout=options.statement_timeout, deadline=deadline,
                liveness=self.liveness,
            )

        self._connections = {"claim": held(), "write": held(None), "control": held(),
                             "maintenance": held(None)}
        capabilities = [Capability(
            d.queue, d.name, d.version, d.retry, d.max_attempts, d.timeout, d.concurrency_limit,
            d.concurrency_scope) for d in served]
        self._wake = asyncio.Event()
        self._book = AttemptBook(
            options.concurrency, self._wake, backlog=options.concurrency + options.prefetch
        )
        self._stopping = asyncio.Event()
        self._immediate = asyncio.Event()
        self._ready = asyncio.Event()
        self._durable = DurableCalls(
            book=self._book,
            engines=TransactionEngines(self._engine),
            make_connection=held,
            size=options.durable_connections,
            on_wait=lambda seconds: self._maintenance.run_within(WaitTimeouts.name, seconds),
        )
        self._completer = Completer(
            connection=self._connections["write"], book=self._book,
            batch_size=options.write_batch_size, lease_seconds=lease,
        )
        self._executor = Executor(
            registry=registry, book=self._book, sink=self._completer, worker_id=self.id,
            lease_seconds=lease, durable=self._durable, on_stuck=options.on_stuck_handler,
        )
        self._leases = LeaseKeeper(
            connection=self._connections["control"], book=self._book, executor=self._executor,
            lease_seconds=lease,
        )
        self._producer = Producer(
            connection=self._connections["claim"], book=self._book, executor=self._executor,
            worker_id=self.id, capabilities=statements.capability_params(self.queues, capabilities),
            lease_seconds=lease, poll_interval=options.poll_interval, prefetch=options.prefetch,
            wake=self._wake, stopping=self._stopping,
        )
        self._maintenance = MaintenanceRunner(
            self._connections["maintenance"], maintenance_services(options)
        )
        self._registration = Registration(
            engine=self._engine, connection=self._connections["control"], worker_id=self.id,
            queues=self.queues, capabilities=capabilities, concurrency=options.concurrency,
            heartbeat_interval=options.heartbeat_interval, ttl=options.worker_ttl,
            lock_timeout=options.effective_lock_timeout,
            declared=registry if registry.schedules else None,
            lock_key=lock_key,
        )
        self._listener = Listener(
            self._engine, self.queues, wake=self._wake.set, wake_all=self._wake_all,
            connect_timeout=quick, lock=lock, deadline=quick, liveness=self.liveness,
        )
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._crashed: tuple[str, BaseException] | None = None
        #: The worker is cancelling its own loops: their ends are not failures.
        self._closing = False
        self._crash = asyncio.Event()
        self._stopped = Stopped()
        self._exit_by = 0.0  # monotonic; set by the stop
        self._observer = observe(self)  # traces and metrics; does nothing if neither is on

    # -- public control ------------------------------------------------------------------

    def shutdown(self, *, immediate: bool = False) -> Awaitable[None]:
        """Stop claiming and drain; a second call (or ``immediate``) stops at once.

        Safe from any thread and signal handler; awaiting it (optional) waits for `run`'s end.
        """
        loop = self._stopped.loop

        def request() -> None:
            if immediate or self._stopping.is_set():
                self._immediate.set()
            self._stopping.set()
            self._wake.set()

        # Before run() there is no loop yet: the flags make run() return right after startup.
        if loop is None:
            request()
        elif not loop.is_closed():
            # Thread-safe even on the loop's own thread: from a signal handler, a plain
            # call_soon would not wake a loop waiting in select() until its next timer.
            with contextlib.suppress(RuntimeError):  # closed in between
                loop.call_soon_threadsafe(request)
        return self._stopped

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        """Return once the worker listens, is registered and its loops run."""
        if timeout is None:
            await self._ready.wait()
        else:
            await bounded(self._ready.wait(), timeout)

    @property
    def draining(self) -> bool:
        return self._registration.draining

    @property
    def active_count(self) -> int:
        """Attempts started (or handed back) and not yet recorded; tasks claimed ahead and
        still waiting for a slot are not counted."""
        return len(self._book.active)

    @property
    def running_count(self) -> int:
        """Handlers running now (at most the concurrency)."""
        return self._book.unsettled

    # -- main ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until `shutdown`; then drain, hand back what is left, and return.

        :raises WorkerCrashed: an internal loop failed; the worker stopped and handed its
            tasks back.
        :raises SchemaNotInstalled: the pgtask schema is missing.
        :raises InvalidOptionError: its connections go through a transaction pooler.
        :raises PolicyConflict: a handler's policy differs from the one frozen in the database.
        """
        self._stopped.start()
        try:
            await self._observer.start()
            await self._check_schema()
            self._spawn("listener", self._listener.run())
            await first(
                self._listener.listening.wait(), self._stopping.wait(), self._crash.wait()
            )
            if not self._crash.is_set() and not self._stopping.is_set():
                await self._maintenance.prime()  # instant rescue's first look at its peers
                await self._registration.register()
                self._spawn("completer", self._completer.run())
                self._spawn("renewer", self._leases.renew_loop())
                self._spawn("watchdog", self._leases.watchdog())
                self._spawn("heartbeat", self._registration.run())
                self._spawn("maintenance", self._maintenance.run())
                self._spawn("producer", self._producer.run())
                self._ready.set()
                loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]
                logger.info("worker %s serving %s with concurrency %d (event loop: %s)", self.id,
                            ", ".join(self.queues), self.options.concurrency, loop)
                await first(self._stopping.wait(), self._crash.wait())
                await self._stop()
        except asyncio.CancelledError:
            logger.warning("worker %s cancelled; handing back its tasks", self.id)
            self._immediate.set()
            with contextlib.suppress(Exception):
                await bounded(self._stop(), min(5.0, self.options.lease_duration))
            raise
        finally:
            await self._close()
            self._stopped.set()
        if self._crashed is not None:
            name, exc = self._crashed
            message = f"the worker's {name} loop failed: {brief(exc)}"
            raise WorkerCrashed(message, loop=name) from exc

    def _spawn(self, name: str, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine, name=f"pgtask-{name}")
        self._loops[name] = task

        def ended(done: asyncio.Task[None]) -> None:
            if self._closing or self._crashed is not None:
                return
            if done.cancelled():
                if (name == "producer" and self._stopping.is_set()) or self._stopped.cancelling():
                    return  # the stop cancels a claim in flight; or run() is cancelled too
                failure: BaseException = RuntimeError(f"{name} loop was cancelled from outside")
            else:
                exc = done.exception()
                if exc is None and name == "producer" and self._stopping.is_set():
                    return  # the claim loop ends by design once stopping
                failure = exc or RuntimeError(f"{name} loop returned")
            # One line: the statement and its traceback are for --log-level debug only.
            logger.error("worker %s: %s loop failed: %s; stopping", self.id, name, brief(failure))
            logger.debug("the %s loop's failure", name, exc_info=failure)
            self._crashed = (name, failure)
            self._immediate.set()
            self._crash.set()

        task.add_done_callback(ended)

    def _wake_all(self) -> None:  # claim and run maintenance now (a reconnect, a clock move)
        self._wake.set()
        self._maintenance.wake()

    async def _check_schema(self) -> None:
        await check_database(self._engine)  # the schema, and no transaction pooler in the way

    async def _stop(self) -> None:
        """Stop claiming, drain within the grace period, hand back what is left."""
        self._stopping.set()
        self._wake.set()
        self._registration.draining = True
        logger.info("worker %s: stopping; no new claims", self.id)
        # Whatever the network does, the process ends by the grace and a few seconds more.
        deadline = time.monotonic() + self.options.shutdown_grace
        self._exit_by = deadline + 4.0
        step = min(_STEP_TIMEOUT, max(1.0, self.options.shutdown_grace / 4))
        producer = self._loops.get("producer")
        if producer is not None and not producer.done():
            if not self._immediate.is_set():
                await first(asyncio.shield(producer), timeout=step)
            await stop_in_flight([self._connections["claim"]], [producer], step)  # swept below
        self._producer.hand_back_waiting()  # now, not after the grace: waiting leases lapse
        if "heartbeat" in self._loops and not self._immediate.is_set():
            with contextlib.suppress(Exception):  # visible as draining at once, not at the end
                await abandon_after(self._registration.heartbeat(), step)
        if self._book.running() and not self._immediate.is_set():
            logger.info("worker %s: waiting up to %.1fs for %d running handler(s)", self.id,
                        self.options.shutdown_grace, len(self._book.running()))
        while self._book.running() and not self._immediate.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._book.changed.clear()
            await first(self._book.changed.wait(), self._immediate.wait(), timeout=remaining)
        leftovers = self._book.running()
        if leftovers:
            logger.warning("worker %s: handing back %d unfinished task(s)", self.id, len(leftovers))
        for attempt in leftovers:
            self._executor.stop(attempt, "shutdown", force=True)
        await self._flush_outcomes()
        if self._crashed is None or self._crashed[0] != "producer":
            with contextlib.suppress(Exception):
                left = self._exit_by - time.monotonic() - 2.0
                await abandon_after(self._producer.hand_back_unknown(), min(_STEP_TIMEOUT, left))
        logger.info("worker %s: stopped", self.id)

    async def _flush_outcomes(self) -> None:
        """Wait for the completer to write what is queued, while leases are still renewed.

        Also after another loop failed: outcomes already decided are worth writing. Bounded by
        the lease: a release written after its lease expired would be fenced out anyway, and
        recovery hands the task back instead.
        """
        await asyncio.sleep(0)  # let stopped handlers settle
        deadline = time.monotonic() + self.options.lease_duration
        deadline = min(deadline, self._exit_by - 2.5) if self._exit_by else deadline
        completer = self._loops.get("completer")
        while self._book.active and completer is not None and not completer.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning(
                    "worker %s: %d outcome(s) not written; their leases will expire",
                    self.id, len(self._book.active),
                )
                return
            self._book.changed.clear()
            await first(
                self._book.changed.wait(), asyncio.shield(self._loops["completer"]),
                timeout=remaining,
            )

    async def _close(self) -> None:
        self._closing = True
        await abandon_after(self._observer.stop(), _STEP_TIMEOUT / 2)
        exit_by = self._exit_by or time.monotonic() + _STEP_TIMEOUT
        handles = self._executor.handles()
        for attempt in self._book.running():
            self._executor.stop(attempt, "shutdown", force=True)
        held = [*self._connections.values(), *self._durable.connections]
        left = exit_by - time.monotonic()
        await stop_in_flight(held, list(self._loops.values()), min(_STEP_TIMEOUT, left / 3))
        if handles:  # an async handler may ignore its cancellation: do not wait forever
            await asyncio.wait(handles, timeout=max(0.01, min(_STEP_TIMEOUT, left / 3)))
        await close_within(
            exit_by, retire=self._registration.retire, connections=held,
            durable=self._durable.engines.close, engine=self._engine if self._owns_engine else None,
        )
        self._executor.close()
