"""worker._maintenance: periodic database housekeeping that any worker may do, one small protocol.

A `MaintenanceService` is a named pass with an interval. The runner runs every service on the
worker's maintenance connection, one at a time, each on its own jittered schedule; a pass that
fails is logged and tried again after a backoff, and never stops the other services or the
worker. Nothing here needs a leader: every pass is written to be harmless when several workers
run it at once (``SKIP LOCKED`` batches).

Services: `Recovery` (expired leases back to pending), `Rescue` (the tasks of workers that are
gone, without waiting for their leases), `WaitTimeouts` (signal and child waits
past their database deadline), `WorkerPruning` (rows of workers long gone), and, in their own
modules, `Schedules` (materialising due schedule occurrences) and `Retention` (expired history
and idempotency reservations); `maintenance_services` builds the list. A pass may ask to run
again sooner than its interval (the next wait falls due), and the worker may ask for a pass
soon (it just registered a wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask.statements.rescue import (
    EXPIRED,
    ORPHANS,
    RECOVER_ONE,
    RESCUE,
    RESCUE_ONE,
    WORKER_LOCKS,
    WORKER_LOCKS_WITHOUT_ENDINGS,
)
from sqlalchemy_pgtask.worker._reconnect import Backoff, HeldConnection, brief, is_transient
from sqlalchemy_pgtask.worker._set_aside import SetAside, batched
from sqlalchemy_pgtask.worker._sightings import Sightings

__all__ = [
    "MaintenanceRunner",
    "MaintenanceService",
    "Recovery",
    "Rescue",
    "WaitTimeouts",
    "WorkerPruning",
]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: Most batches one pass of a batched service runs before yielding to the next service.
MAX_BATCHES_PER_PASS = 16
#: Seconds before looking again at due waits that other transactions held.
_HELD_RETRY = 0.5


class MaintenanceService(Protocol):
    """One kind of housekeeping."""

    #: Shown in logs.
    name: str
    #: Seconds between passes (the runner spreads them by +-20%).
    interval: float

    async def run_once(self, connection: AsyncConnection) -> float | None:
        """One pass; raise to have it retried after a backoff.

        Returns the seconds until it wants to run again if sooner than its interval, or None.
        """


class Recovery:
    """Returns tasks whose lease expired (their worker died or stalled) to pending."""

    name = "recovery"

    def __init__(
        self, *, interval: float, batch_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._batch = batch_size
        #: Tasks whose recovery another transaction held back (a descendant its cascade
        #: cancels, its waiting parent, its attempt row), or that ran past statement_timeout.
        self._aside = SetAside("recovery", clock=clock)

    async def run_once(self, connection: AsyncConnection) -> float | None:
        for _ in range(MAX_BATCHES_PER_PASS):
            rows = await batched(
                connection, self._aside, {"limit": self._batch},
                batch=statements.RECOVER, listing=EXPIRED, one=RECOVER_ONE,
            )
            self._aside.release([row.id for row in rows])
            if rows:
                logger.warning("recovered %d task(s) with expired leases", len(rows))
            if len(rows) < self._batch:
                break
        return self._aside.until_next()


class Rescue:
    """Takes back at once the running tasks of workers whose connections are all gone.

    Which workers are gone is `worker._sightings.Sightings`'s verdict on each look at the
    workers' advisory locks (`statements.rescue`): a process that went away, not sessions the
    server ended itself.
    """

    name = "rescue"

    def __init__(
        self, *, interval: float, batch_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._batch = batch_size
        self._sightings = Sightings()
        self._aside = SetAside("rescue", clock=clock)

    async def run_once(self, connection: AsyncConnection) -> float | None:
        counted = (connection.dialect.server_version_info or (14,)) >= (14,)
        look = WORKER_LOCKS if counted else WORKER_LOCKS_WITHOUT_ENDINGS
        doomed = self._sightings.gone((await connection.execute(look)).one())
        rescued = 0
        for _ in range(MAX_BATCHES_PER_PASS) if doomed else ():
            rows = await batched(
                connection, self._aside, {"owners": list(doomed), "limit": self._batch},
                batch=RESCUE, listing=ORPHANS, one=RESCUE_ONE,
            )
            self._aside.release([row.id for row in rows])
            rescued += len(rows)
            if len(rows) < self._batch:
                break
        if doomed and not rescued and not len(self._aside):
            # Nothing of theirs is left running: forget them until seen holding a lock again.
            self._sightings.forget(doomed)
        if rescued:
            logger.warning(
                "rescued %d task(s) of %d worker(s) that are gone, before their leases expired",
                rescued, len(doomed),
            )
        # A lock just found missing: look again soon (a worker that only lost its
        # connections for a moment has taken it again by then), not a whole interval later.
        sooner = self.interval / 2 if self._sightings.missing else None
        rest = self._aside.until_next()
        return rest if sooner is None else sooner if rest is None else min(sooner, rest)


class WaitTimeouts:
    """Times out signal and child-result waits whose database deadline has passed.

    A wait whose rows another transaction holds (its task, its child, any task in the child's
    subtree) is skipped by the batch statement; after a batch that failed all the same (past
    ``statement_timeout``, say) the due waits are tried one at a time. Either way a wait that
    cannot be timed out now is set aside (`worker._set_aside`) with a log line naming its task,
    and the others go ahead.
    """

    name = "wait timeouts"

    def __init__(
        self, *, interval: float, batch_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._batch = batch_size
        self._aside = SetAside("wait timeout", clock=clock)

    async def run_once(self, connection: AsyncConnection) -> float | None:
        woken = 0
        for _ in range(MAX_BATCHES_PER_PASS):
            rows = await batched(
                connection, self._aside, {"limit": self._batch},
                batch=statements.WAIT_TIMEOUTS, listing=statements.DUE_WAITS,
                one=statements.WAIT_TIMEOUT,
            )
            done = [row.id for row in rows if not row.held]
            self._aside.release(done)
            for row in rows:
                if row.held:
                    self._aside.hold(row.id, "a transaction holds its task or its child's tree")
            woken += len(done)
            if done:
                logger.info("%d wait(s) timed out", len(done))
            if len(rows) < self._batch:
                break
        due = (await connection.execute(
            statements.NEXT_WAIT_TIMEOUT, {"aside": self._aside.resting()}
        )).scalar()
        rest = self._aside.until_next()
        if due is None:
            return rest
        seconds = max(0.0, float(due))
        if due <= 0 and not woken:
            # Due, yet nothing could be taken: another pass holds those rows. Look again in
            # a moment rather than spin.
            seconds = min(self.interval, _HELD_RETRY)
        return seconds if rest is None else min(rest, seconds)


class WorkerPruning:
    """Deletes the rows of workers that expired more than ``retention`` seconds ago."""

    name = "worker pruning"

    def __init__(self, *, interval: float, retention: float, batch_size: int = 1000) -> None:
        self.interval = interval
        self._retention = retention
        self._batch = batch_size

    async def run_once(self, connection: AsyncConnection) -> float | None:
        for _ in range(MAX_BATCHES_PER_PASS):
            rows = (
                await connection.execute(
                    statements.PRUNE_WORKERS,
                    {"retention_seconds": self._retention, "limit": self._batch},
                )
            ).all()
            if rows:
                logger.info("pruned %d expired worker row(s)", len(rows))
            if len(rows) < self._batch:
                break
        return None


class MaintenanceRunner:
    def __init__(
        self, connection: HeldConnection, services: Sequence[MaintenanceService]
    ) -> None:
        self._connection = connection
        self._services = list(services)
        self._wake = asyncio.Event()
        #: Monotonic times some services were asked to run by (see `run_within`).
        self._asked: dict[str, float] = {}
        self._all = False
        #: When each service that `prime` ran is next due.
        self._primed: dict[int, float] = {}

    def wake(self) -> None:
        """Run every service now (the database clock moved, or the listener reconnected)."""
        self._all = True
        self._wake.set()

    def run_within(self, name: str, seconds: float) -> None:
        """Run the service called ``name`` within ``seconds`` (sooner if already due)."""
        at = time.monotonic() + seconds
        if at < self._asked.get(name, float("inf")):
            self._asked[name] = at
            self._wake.set()

    async def prime(self) -> None:
        """Run the rescue pass once, before the worker registers.

        A rescuer acts only for workers it saw holding their lock or that registered after
        its first look. Looking before this worker is registered (and so before anyone can
        see it ready) covers every peer alive at that moment: one killed right after this
        worker started is rescued at once, not left to its lease. A failure is left to the
        regular passes.
        """
        for service in self._services:
            if service.name != Rescue.name:
                continue
            try:
                async with self._connection.use(each_statement=True) as connection:
                    await service.run_once(connection)
            except Exception as exc:
                # Not reported here: registration fails next for most causes (a missing table
                # or privilege), with one clear error, and the regular passes report the rest.
                logger.debug("%s before registering failed (%s)", service.name, brief(exc))
            else:
                self._primed[id(service)] = time.monotonic() + service.interval

    async def run(self) -> None:
        now = time.monotonic()
        due = {id(s): self._primed.get(id(s), now) for s in self._services}
        backoffs = {id(s): Backoff(cap=max(s.interval, 1.0)) for s in self._services}
        while True:
            if self._wake.is_set():
                self._wake.clear()
                if self._all:
                    self._all = False
                    due = dict.fromkeys(due, time.monotonic())
                asked, self._asked = self._asked, {}
                for s in self._services:
                    if s.name in asked:
                        due[id(s)] = min(due[id(s)], asked[s.name])
            service = min(self._services, key=lambda s: due[id(s)])
            delay = due[id(service)] - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await bounded(self._wake.wait(), delay)
                continue
            sooner: float | None = None
            try:
                # A pass may run many statements (a batch cut short by statement_timeout,
                # then its tasks one by one): each gets the whole deadline, or the pass would
                # be severed before it sets aside the task that cut it short.
                async with self._connection.use(each_statement=True) as connection:
                    sooner = await service.run_once(connection)
            except Exception as exc:
                wait = backoffs[id(service)].next()
                if is_transient(exc):
                    logger.warning("%s failed (%s); again in %.2fs", service.name, brief(exc), wait)
                elif isinstance(exc, DBAPIError):  # refused: its reason, not the statement
                    logger.error("%s failed (%s); again in %.2fs", service.name, brief(exc), wait)
                    logger.debug("the %s failure", service.name, exc_info=exc)
                else:
                    logger.exception("%s failed; again in %.2fs", service.name, wait)
            else:
                backoffs[id(service)].reset()
                wait = service.interval * random.uniform(0.8, 1.2)  # noqa: S311
                if sooner is not None:
                    wait = min(wait, sooner)
            due[id(service)] = time.monotonic() + wait
