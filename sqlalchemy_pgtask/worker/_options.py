"""worker._options: how a worker runs, validated once when the options are made; no I/O."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Final, Literal, get_args

from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.validation import check_queue_name
from sqlalchemy_pgtask.worker._deadlines import quick_deadline
from sqlalchemy_pgtask.worker._stuck import ON_STUCK_HANDLER, OnStuckHandler

__all__ = ["EVENT_LOOPS", "MAX_DURATION_SECONDS", "EventLoop", "WorkerOptions"]

#: The event loops `sqlalchemy_pgtask.worker.run` can run on; ``auto`` is uvloop if it can
#: be imported, else asyncio's own.
EventLoop = Literal["auto", "asyncio", "uvloop"]
EVENT_LOOPS: Final[tuple[str, ...]] = get_args(EventLoop)

#: The longest duration any worker option accepts (a day): beyond it a lease or a timeout is a
#: mistake, and an infinite one would reach PostgreSQL as an interval it cannot represent.
MAX_DURATION_SECONDS: Final = 86_400.0


def _duration(name: str, value: object, *, low: float, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(name, f"must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise InvalidOptionError(name, f"must be finite, got {value!r}")
    if seconds == 0 and allow_zero:
        return seconds
    if not low <= seconds <= MAX_DURATION_SECONDS:
        raise InvalidOptionError(
            name, f"must be between {low:g} and {MAX_DURATION_SECONDS:g} seconds, got {value!r}"
        )
    return seconds


def _count(name: str, value: object, high: int, *, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidOptionError(name, f"must be an int between {low} and {high}, got {value!r}")
    return value


def _check_metrics(port: object, host: object, interval: object) -> None:
    _duration("metrics_interval", interval, low=0.05)
    if not isinstance(host, str) or not host:
        raise InvalidOptionError("metrics_host", f"must be a host name or address, got {host!r}")
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65_535:
        raise InvalidOptionError(
            "metrics_port", f"must be an int between 0 and 65535, got {port!r}"
        )
    if importlib.util.find_spec("prometheus_client") is None:
        raise InvalidOptionError(
            "metrics_port",
            "needs the prometheus-client package: pip install 'sqlalchemy-pgtask[metrics]'",
        )


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """How a `Worker` runs. Durations are in seconds.

    The ``pgtask worker`` command's defaults are these fields' defaults.
    """

    #: Queues to serve, in priority order (earlier queues are drained first). Default: every
    #: queue that has a handler in the registry.
    queues: tuple[str, ...] | None = None
    #: Most handlers running at once.
    concurrency: int = 10
    #: Most tasks claimed ahead of free slots, to wait for one, while handlers finish fast:
    #: as many as would start within 50 ms at the handlers' recent pace, each handed back if
    #: it waited a second (see ``docs/worker.md``, "Claiming ahead"). 0: claim only for free
    #: slots.
    prefetch: int = 100
    #: How long a claim is valid without renewal; renewed every third of it. A handler whose
    #: lease could not be renewed is stopped (and its task handed back) at three quarters of
    #: it, before the lease can expire and another worker start the task again.
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
    #: The longest any worker statement may wait for a lock; None: a quarter of the lease
    #: (at most 2 s), so a renewal that waits still leaves time to try again.
    lock_timeout: float | None = None
    #: The longest any worker statement may run.
    statement_timeout: float = 60.0
    #: How long a worker row stays after the worker stopped or vanished, for operators' eyes.
    worker_retention: float = 3600.0
    #: Connections the worker holds for handlers' durable calls (steps, sleeps, waits,
    #: spawns); each call takes one for a single statement. ``ctx.transaction`` blocks use
    #: the engine's pool instead.
    durable_connections: int = 4
    #: Rescue the tasks of a dead worker at once instead of at lease expiry: every
    #: connection of a worker holds a shared advisory lock, and a worker whose lock is gone
    #: is dead. Turn off behind a transaction-pooling proxy (locks say nothing there; leases
    #: still recover the tasks).
    instant_rescue: bool = True
    #: Seconds between looks for dead workers' tasks (a worker is gone when its lock was
    #: missing on two looks in a row).
    rescue_interval: float = 0.5
    #: Due wait timeouts handled per statement (up to 16 statements per pass).
    wait_timeout_batch_size: int = 100
    #: The longest the schedule materialiser sleeps (otherwise it sleeps exactly until the
    #: next schedule falls due): bounds how late a schedule created meanwhile is noticed.
    schedule_interval: float = 5.0
    #: Most schedules one materialising transaction locks and materialises.
    schedule_batch_size: int = 100
    #: Seconds between retention passes (expired history and idempotency reservations).
    retention_interval: float = 60.0
    #: Rows one retention statement deletes (up to 16 statements of each kind per pass).
    retention_batch_size: int = 1000
    #: Serve Prometheus metrics (``/metrics``) and the probes ``/healthz`` and ``/readyz`` on
    #: this TCP port (0: any free port, logged); None: no server, no port opened. Needs the
    #: ``metrics`` extra (``prometheus-client``). See ``docs/observability.md``.
    metrics_port: int | None = None
    #: The address the metrics server listens on.
    metrics_host: str = "127.0.0.1"
    #: Seconds between samples of the queues' backlog (one statement each time).
    metrics_interval: float = 10.0
    #: ``/healthz`` answers 503 once the worker has completed no round trip to PostgreSQL
    #: for longer than this. None: the lease duration (at least twice the deadline of the
    #: worker's hot statements, `health_timeout_seconds`): a worker that cannot reach the
    #: database for a lease can renew none of its leases.
    health_timeout: float | None = None
    #: What to do about a ``def`` handler still running, after its stop request, when its
    #: lease can expire (Python cannot interrupt it): ``"warn"`` logs it and serves on (a
    #: second run may overlap it); ``"exit"`` ends the process with status 75 so that none
    #: does (see ``docs/worker.md``, "Stuck handlers").
    on_stuck_handler: OnStuckHandler = "warn"

    def __post_init__(self) -> None:
        _count("concurrency", self.concurrency, 10_000)
        _count("prefetch", self.prefetch, 100_000, low=0)
        _duration("lease_duration", self.lease_duration, low=0.3)
        _duration("poll_interval", self.poll_interval, low=0.001)
        _duration("heartbeat_interval", self.heartbeat_interval, low=0.01)
        _duration("worker_ttl", self.worker_ttl, low=0.02)
        _duration("shutdown_grace", self.shutdown_grace, low=0.0, allow_zero=True)
        _duration("statement_timeout", self.statement_timeout, low=0.1)
        _duration("worker_retention", self.worker_retention, low=0.0, allow_zero=True)
        if self.lock_timeout is not None:
            _duration("lock_timeout", self.lock_timeout, low=0.001)
            if self.lock_timeout > self.lease_duration / 3:
                raise InvalidOptionError(
                    "lock_timeout", "must be at most a third of lease_duration"
                )
        if self.heartbeat_interval >= self.worker_ttl:
            raise InvalidOptionError("heartbeat_interval", "must be shorter than worker_ttl")
        _count("recovery_batch_size", self.recovery_batch_size, 100_000)
        _count("write_batch_size", self.write_batch_size, 100_000)
        _count("durable_connections", self.durable_connections, 100)
        _count("wait_timeout_batch_size", self.wait_timeout_batch_size, 100_000)
        if not isinstance(self.instant_rescue, bool):
            raise InvalidOptionError("instant_rescue", "must be a bool")
        _duration("rescue_interval", self.rescue_interval, low=0.01)
        _duration("schedule_interval", self.schedule_interval, low=0.01)
        _count("schedule_batch_size", self.schedule_batch_size, 10_000)
        _duration("retention_interval", self.retention_interval, low=0.01)
        _count("retention_batch_size", self.retention_batch_size, 100_000)
        _check_metrics(self.metrics_port, self.metrics_host, self.metrics_interval)
        if self.on_stuck_handler not in ON_STUCK_HANDLER:
            raise InvalidOptionError(
                "on_stuck_handler", f"must be 'warn' or 'exit', got {self.on_stuck_handler!r}"
            )
        if self.health_timeout is not None:
            _duration("health_timeout", self.health_timeout, low=0.1)
        if self.queues is not None:
            if isinstance(self.queues, str) or not isinstance(self.queues, tuple):
                raise InvalidOptionError("queues", "must be a tuple of queue names")
            if not self.queues:
                raise InvalidOptionError("queues", "must not be empty")
            for q in self.queues:
                check_queue_name(q, "queues")
            if len(set(self.queues)) != len(self.queues):
                raise InvalidOptionError("queues", "must not repeat a queue")

    @property
    def health_timeout_seconds(self) -> float:
        """`health_timeout`, or its default: the lease, at least twice the hot statements'
        deadline (the idle listener's round trips come that often)."""
        if self.health_timeout is not None:
            return self.health_timeout
        quick = quick_deadline(self.lease_duration, self.statement_timeout)
        return max(self.lease_duration, 2 * quick)

    @property
    def effective_lock_timeout(self) -> float:
        """`lock_timeout`, or its default derived from the lease."""
        if self.lock_timeout is not None:
            return self.lock_timeout
        return min(2.0, self.lease_duration / 4)
