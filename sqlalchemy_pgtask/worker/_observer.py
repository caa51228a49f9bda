"""worker._observer: what the worker's loops report as they go, to traces and metrics; a hook
never fails the loop that calls it.

The loops call the hooks of one `Observer` (the attempt book carries it, so every loop that
shares the book reaches it; the base is defined beside the book, in `_attempts`, so that the
loops need not import this module). The default, `NO_OBSERVER`, does nothing: with
OpenTelemetry not installed and no metrics port, a hook is one method call that returns at
once. A hook that fails (a broken exporter) is logged and forgotten; the task's work never
depends on it.

Attempts are counted by what was written, when it was written (the statement says the task's
new state): a success fenced out, or stored as cancelled by a request only the database knew,
is not a success.

`WorkerObserver` also answers the probes: ``/healthz`` (the process runs, none of the
worker's loops has ended, and it completed a round trip to PostgreSQL within
``health_timeout``) and ``/readyz`` (registered, listening, reaching the database, its last
claim succeeded, and not draining).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Protocol

from sqlalchemy_pgtask import telemetry
from sqlalchemy_pgtask.worker._attempts import NO_OBSERVER, Observer

if TYPE_CHECKING:
    import uuid
    from collections.abc import Mapping

    from sqlalchemy.ext.asyncio import AsyncEngine

    from sqlalchemy_pgtask.outcome import Outcome
    from sqlalchemy_pgtask.worker._attempts import ActiveAttempt, AttemptBook
    from sqlalchemy_pgtask.worker._completer import Completer
    from sqlalchemy_pgtask.worker._deadlines import Liveness
    from sqlalchemy_pgtask.worker._http import ProbeServer, Response
    from sqlalchemy_pgtask.worker._listener import Listener
    from sqlalchemy_pgtask.worker._metrics import Metrics
    from sqlalchemy_pgtask.worker._options import WorkerOptions
    from sqlalchemy_pgtask.worker._producer import Producer
    from sqlalchemy_pgtask.worker._reconnect import HeldConnection

__all__ = [
    "ObservedWorker", "WorkerObserver", "describe_outcome", "observe", "written_label",
]

logger = logging.getLogger("sqlalchemy_pgtask.worker")


class ObservedWorker(Protocol):
    """What the observer reads of the worker it watches (the `Worker`): a protocol, so that
    this part does not import the runtime that composes it."""

    @property
    def id(self) -> uuid.UUID: ...
    @property
    def options(self) -> WorkerOptions: ...
    @property
    def queues(self) -> tuple[str, ...]: ...
    @property
    def liveness(self) -> Liveness: ...
    @property
    def draining(self) -> bool: ...
    @property
    def _engine(self) -> AsyncEngine: ...
    @property
    def _crashed(self) -> tuple[str, BaseException] | None: ...
    @property
    def _stopping(self) -> asyncio.Event: ...
    @property
    def _ready(self) -> asyncio.Event: ...
    @property
    def _loops(self) -> Mapping[str, asyncio.Task[None]]: ...
    @property
    def _book(self) -> AttemptBook: ...
    @property
    def _completer(self) -> Completer: ...
    @property
    def _listener(self) -> Listener: ...
    @property
    def _producer(self) -> Producer: ...
    @property
    def _connections(self) -> Mapping[str, HeldConnection]: ...


def describe_outcome(attempt: ActiveAttempt, outcome: Outcome | None) -> tuple[str, bool]:
    """What the attempt led to, as the logs say it, and whether that is an error.

    ``succeeded``, ``retrying``, ``failed``, ``cancelled``, ``released`` (handed back: a
    shutdown, a lease about to expire), ``suspended`` (a durable sleep or wait) or
    ``lease_lost`` (nothing was written).
    """
    if attempt.suspended:
        return "suspended", False
    if outcome is None:
        return "lease_lost", False
    if outcome.kind == "release":
        return "released", False
    # The outcome statements store a cancelled task's success or failure as cancelled: say so
    # when the worker already knows of the request (one made after its last renewal is known
    # only to the database, and counted by what the handler did).
    if outcome.error_kind == "cancelled" or attempt.ctx.stop_reason == "cancelled":
        return "cancelled", False
    if outcome.kind == "complete":
        return "succeeded", False
    ctx = attempt.ctx
    # The write retries only while failed attempts remain (as the executor's log says).
    budget_left = ctx.max_attempts is None or ctx.failed_attempts + 1 < ctx.max_attempts
    return ("retrying" if outcome.delay is not None and budget_left else "failed"), True


def written_label(outcome: Outcome, state: str) -> str:
    """What a written outcome led to, from the state the statement left the task in:
    ``succeeded``, ``failed``, ``cancelled``, ``retrying`` or ``released``."""
    if state == "pending":
        return "released" if outcome.kind == "release" else "retrying"
    return state


class WorkerObserver(Observer):
    """Traces attempts and steps (when OpenTelemetry is installed) and keeps the metrics and
    the probe server (when the worker has a metrics port)."""

    def __init__(
        self, worker: ObservedWorker, *, tracing: bool, metrics: Metrics | None
    ) -> None:
        self._worker = worker
        self._tracing = tracing
        self.metrics = metrics
        self._spans: dict[ActiveAttempt, telemetry.AttemptSpan] = {}
        self._owners: set[int] = set()
        #: Whether the last backlog sample reached the database (None: none yet).
        self.database_reachable: bool | None = None
        self.server: ProbeServer | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._failed_once = False
        #: Monotonic end of each handler whose outcome is still to be written.
        self._ended: dict[ActiveAttempt, float] = {}

    def _failed(self, hook: str) -> None:
        if not self._failed_once:  # once: a broken exporter would otherwise flood the log
            self._failed_once = True
            logger.exception("telemetry hook %s failed; the worker goes on without it", hook)

    # -- hooks ---------------------------------------------------------------------------

    def attempt_started(self, attempt: ActiveAttempt) -> None:
        try:
            if self._tracing and telemetry.ENABLED and telemetry.recording():
                self._spans[attempt] = telemetry.start_attempt_span(attempt.ctx)
            if self.metrics is not None:
                self.metrics.started.labels(attempt.ctx.queue, attempt.ctx.name).inc()
        except Exception:
            self._failed("attempt_started")

    def attempt_finished(
        self, attempt: ActiveAttempt, outcome: Outcome | None, raised: BaseException | None
    ) -> None:
        try:
            label, error = describe_outcome(attempt, outcome)
            span = self._spans.pop(attempt, None)
            if span is not None:
                span.end(label, raised, error)
            if self.metrics is None:
                return
            if outcome is None:  # suspended, or its lease lost: nothing is to be written
                self._duration(attempt, label, time.monotonic())
            else:
                self._ended[attempt] = time.monotonic()
        except Exception:
            self._failed("attempt_finished")

    def _duration(self, attempt: ActiveAttempt, label: str, ended: float) -> None:
        assert self.metrics is not None
        self.metrics.duration.labels(attempt.ctx.queue, attempt.ctx.name, label).observe(
            ended - attempt.started_at
        )

    def _written(self, attempt: ActiveAttempt, label: str) -> bool:
        """Observe the handler's duration under ``label``; False for an outcome of no
        handler's (a row claimed ahead handed back) or without metrics."""
        ended = self._ended.pop(attempt, None)
        if self.metrics is None or ended is None:
            return False
        self._duration(attempt, label, ended)
        return True

    def outcome_written(self, attempt: ActiveAttempt, outcome: Outcome, state: str) -> None:
        try:
            label = written_label(outcome, state)
            if not self._written(attempt, label):
                return
            assert self.metrics is not None
            queue, name = attempt.ctx.queue, attempt.ctx.name
            if label == "succeeded":
                self.metrics.succeeded.labels(queue, name).inc()
            elif label in ("failed", "retrying"):
                counter = self.metrics.failed if label == "failed" else self.metrics.retried
                counter.labels(queue, name, outcome.error_kind or "unknown").inc()
        except Exception:
            self._failed("outcome_written")

    def outcome_lost(self, attempt: ActiveAttempt, outcome: Outcome) -> None:
        try:
            self._written(attempt, "lease_lost")
        except Exception:
            self._failed("outcome_lost")

    def outcome_given_up(self, attempt: ActiveAttempt, outcome: Outcome, reason: str) -> None:
        try:
            if self.metrics is not None:
                self.metrics.given_up.labels(attempt.ctx.queue, attempt.ctx.name, reason).inc()
            self._written(attempt, "given_up")
        except Exception:
            self._failed("outcome_given_up")

    def claimed(self, count: int) -> None:
        if self.metrics is not None:
            self.metrics.claim_batch.observe(count)

    def leases_renewed(self, count: int) -> None:
        if self.metrics is not None:
            self.metrics.renewals.inc(count)

    def lease_lost(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.losses.labels(reason).inc()

    def connected(self, owner: object) -> None:
        key = id(owner)  # owners live as long as the worker: their ids stay theirs
        if key not in self._owners:
            self._owners.add(key)
        elif self.metrics is not None:
            self.metrics.reconnects.inc()

    # -- probes --------------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """Alive: no loop of the worker has ended (while it is not stopping)."""
        worker = self._worker
        if worker._crashed is not None:
            return False, f"the {worker._crashed[0]} loop failed"
        if worker._stopping.is_set():
            return True, "stopping"
        ended = sorted(name for name, loop in worker._loops.items() if loop.done())
        if ended:
            return False, f"loop ended: {', '.join(ended)}"
        silent, limit = worker.liveness.silent_for(), worker.options.health_timeout_seconds
        if silent > limit:
            return False, f"no round trip to PostgreSQL for {silent:.1f} s (limit {limit:g} s)"
        return True, "ok" if worker._ready.is_set() else "starting"

    def readiness(self) -> tuple[bool, str]:
        """Ready: registered with its loops running, listening, reaching the database."""
        alive, why = self.health()
        worker = self._worker
        if not alive:
            return False, why
        if worker._stopping.is_set() or worker.draining:
            return False, "draining"
        if not worker._ready.is_set():
            return False, "not registered yet"
        if not worker._listener.listening.is_set():
            return False, "not listening (reconnecting)"
        if self.database_reachable is False:
            return False, "database unreachable"
        if worker._producer.failing:
            return False, "cannot claim (the last claim failed; retrying)"
        return True, "ready"

    def _probe(self, ready: bool) -> Response:
        from sqlalchemy_pgtask.worker._http import text

        ok, why = self.readiness() if ready else self.health()
        return text(200 if ok else 503, why)

    def _scrape(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        assert self.metrics is not None
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry)

    def _reachable(self, reached: bool) -> None:
        self.database_reachable = reached

    async def start(self) -> None:
        options = self._worker.options
        if self.metrics is None or options.metrics_port is None:
            return
        from sqlalchemy_pgtask.worker._http import ProbeServer
        from sqlalchemy_pgtask.worker._metrics import sample_backlog

        self.server = ProbeServer(
            options.metrics_host, options.metrics_port,
            {
                "/metrics": self._scrape,
                "/healthz": lambda: self._probe(False),
                "/readyz": lambda: self._probe(True),
            },
        )
        await self.server.start()
        logger.info(
            "worker %s: metrics and probes on http://%s:%d/metrics (/healthz, /readyz)",
            self._worker.id, self.server.host, self.server.port,
        )

        metrics = self.metrics

        async def sample_when_ready() -> None:
            await self._worker._ready.wait()
            await sample_backlog(
                self._worker._engine, self._worker.queues, metrics,
                interval=options.metrics_interval, connected=self._reachable,
            )

        self._sampler = asyncio.create_task(sample_when_ready(), name="pgtask-metrics-sampler")

    async def stop(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(BaseException):
                await sampler
        if self.server is not None:
            await self.server.close()


def observe(worker: ObservedWorker) -> Observer:
    """The observer ``worker`` needs, hooked into its loops; `NO_OBSERVER` if none."""
    options = worker.options
    tracing = telemetry.ENABLED
    if not tracing and options.metrics_port is None:
        return NO_OBSERVER
    metrics = None
    if options.metrics_port is not None:
        from sqlalchemy_pgtask.worker._metrics import Metrics

        book, completer = worker._book, worker._completer
        metrics = Metrics(
            concurrency=options.concurrency, running=lambda: book.unsettled,
            set_aside=lambda: completer.set_aside,
        )
    if tracing:
        telemetry.load_provider()
    observer = WorkerObserver(worker, tracing=tracing, metrics=metrics)
    worker._book.observer = observer
    worker._listener.observer = observer
    for connection in worker._connections.values():
        connection.observer = observer
    return observer
