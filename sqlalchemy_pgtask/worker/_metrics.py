"""worker._metrics: the worker's Prometheus metrics, and the sampler of its queues' backlog.

Every worker has its own `CollectorRegistry` (never the process-wide default), so several
workers in one process, and the tests, never share a counter. Counters are moved by the
observer's hooks as things happen; nothing is computed per scrape except the running-slot
gauge, which reads a number the worker already holds.

The backlog of the worker's queues (how many due tasks wait, and how long the oldest has
waited) is *sampled*: one statement every ``metrics_interval`` seconds, whatever the scrape
rate and however many tasks wait, never a statement per task or per scrape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import Boolean, Row, Select, Text, bindparam, func, literal_column, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask.models import Task
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.worker._reconnect import brief

__all__ = ["KEY_WAITING_MAX", "QUEUE_BACKLOG", "Metrics", "sample_backlog"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

_TASK: Final = ("queue", "name")

#: Seconds; from a millisecond step to the default lease and beyond.
_DURATION_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
)
#: Rows per claim; 0 is an idle poll.
_BATCH_BUCKETS: Final = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
#: Tasks waiting for a concurrency key counted at most per queue and sample.
KEY_WAITING_MAX: Final = 10_000


def _backlog_statement() -> Select[Any]:
    queue = (
        func.unnest(bindparam("queues", type_=ARRAY(Text)))
        .table_valued("queue")
        .render_derived(name="q")
    )
    # A literal state matches the partial index's predicate in any plan (a bound one would
    # match only in a custom plan).
    due = (
        Task.queue == queue.c.queue,
        Task.state == literal_column("'pending'"),
        Task.run_at <= NOW,
    )
    depth = select(func.count()).where(*due).scalar_subquery()
    oldest = select(func.min(Task.run_at)).where(*due).scalar_subquery()
    # The claim's own test, through ix_tasks_concurrency_pending; a hot key's backlog is
    # counted up to a bound, so one sample never walks it whole.
    refused = (
        select(Task.id)
        .where(
            *due, Task.concurrency_key.is_not(None), Task.concurrency_held.is_(False),
            ~func.pgtask.concurrency_admits(Task.id, type_=Boolean),
        )
        .limit(KEY_WAITING_MAX)
        .subquery()
    )
    return select(
        queue.c.queue,
        depth.label("depth"),
        func.coalesce(func.extract("epoch", NOW - oldest), 0).label("age"),
        select(func.count()).select_from(refused).scalar_subquery().label("key_waiting"),
    )


#: For each of the ``queues``: its due pending tasks (``depth``) and the seconds since the
#: oldest of them fell due (``age``, 0 when none is due). Locks nothing. Each queue costs two
#: probes of ``ix_tasks_pending_run_at`` (queue, run_at) WHERE state = 'pending': the count
#: reads the due range of the index, the minimum its first entry; future tasks, running and
#: finished history are never read. ``key_waiting``: the due tasks the claim passes over for
#: their concurrency key (at most `KEY_WAITING_MAX`).
QUEUE_BACKLOG: Final = _backlog_statement()


class Metrics:
    """One worker's metric families, in a registry of its own."""

    def __init__(
        self, *, concurrency: int, running: Callable[[], float], set_aside: Callable[[], float]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.started = Counter(
            "pgtask_tasks_started", "Attempts started (claimed and handed to a handler).",
            _TASK, registry=registry,
        )
        self.succeeded = Counter(
            "pgtask_tasks_succeeded", "Attempts whose result was stored (counted when written).",
            _TASK, registry=registry,
        )
        self.failed = Counter(
            "pgtask_tasks_failed",
            "Attempts stored as failed with no retry to follow (counted when written).",
            (*_TASK, "error_kind"), registry=registry,
        )
        self.retried = Counter(
            "pgtask_tasks_retried",
            "Attempts stored as failed with a retry to follow (counted when written).",
            (*_TASK, "error_kind"), registry=registry,
        )
        self.duration = Histogram(
            "pgtask_attempt_duration_seconds",
            "Seconds from the handler's start to its end, by what the attempt led to.",
            (*_TASK, "outcome"), buckets=_DURATION_BUCKETS, registry=registry,
        )
        self.given_up = Counter(
            "pgtask_outcomes_given_up",
            "Outcomes the writer gave up after tries cut short by a lock or statement_timeout "
            "(the task is recovered once its lease expires).",
            (*_TASK, "reason"), registry=registry,
        )
        Gauge(
            "pgtask_outcomes_set_aside",
            "Outcomes waiting to be written again (their row was locked, a try was cut short).",
            registry=registry,
        ).set_function(set_aside)
        self.claim_batch = Histogram(
            "pgtask_claim_batch_size", "Tasks taken by each claim statement (0: nothing due).",
            buckets=_BATCH_BUCKETS, registry=registry,
        )
        Gauge(
            "pgtask_worker_slots", "Handlers the worker runs at most (its concurrency).",
            registry=registry,
        ).set(concurrency)
        Gauge(
            "pgtask_worker_running_slots", "Handlers running now.", registry=registry
        ).set_function(running)
        self.renewals = Counter(
            "pgtask_lease_renewals", "Leases extended by the renewal loop.", registry=registry
        )
        self.losses = Counter(
            "pgtask_lease_losses",
            "Handlers stopped for their lease: 'lost' (another attempt owns the task now) or "
            "'expiring' (not renewed in time; the task is handed back).",
            ("reason",), registry=registry,
        )
        self.reconnects = Counter(
            "pgtask_reconnects",
            "Worker connections (claims, writes, control, maintenance, LISTEN) opened again "
            "after they were lost.",
            registry=registry,
        )
        self.depth = Gauge(
            "pgtask_queue_depth", "Due pending tasks in the queue (sampled).", ("queue",),
            registry=registry,
        )
        self.oldest = Gauge(
            "pgtask_queue_oldest_pending_age_seconds",
            "Seconds since the queue's oldest due pending task fell due (sampled; 0: none).",
            ("queue",), registry=registry,
        )
        self.key_waiting = Gauge(
            "pgtask_queue_concurrency_key_waiting",
            "Due pending tasks waiting for their concurrency key (sampled; at most 10,000).",
            ("queue",), registry=registry,
        )


async def sample_backlog(
    engine: AsyncEngine,
    queues: Sequence[str],
    metrics: Metrics,
    *,
    interval: float,
    connected: Callable[[bool], None],
) -> None:
    """Sample the queues' backlog every ``interval`` seconds, forever; never raises.

    ``connected`` hears whether each sample reached the database (readiness uses it).
    """
    params = {"queues": list(queues)}
    timeout = max(5.0, interval)
    while True:
        try:
            rows = await bounded(_read(engine, params), timeout)
        except Exception as exc:  # a sample is worth nothing next to the worker's own work
            connected(False)
            logger.warning("queue backlog not sampled (%s)", brief(exc))
        else:
            connected(True)
            for row in rows:
                metrics.depth.labels(row.queue).set(row.depth)
                metrics.oldest.labels(row.queue).set(float(row.age))
                metrics.key_waiting.labels(row.queue).set(row.key_waiting)
        await asyncio.sleep(interval)


async def _read(engine: AsyncEngine, params: dict[str, Any]) -> Sequence[Row[Any]]:
    async with engine.connect() as conn:
        rows: Sequence[Row[Any]] = (await conn.execute(QUEUE_BACKLOG, params)).all()
    return rows
