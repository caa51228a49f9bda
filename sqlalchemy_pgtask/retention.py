"""retention: delete expired task history, idempotency reservations and worker rows.

History grows with every task: the task row, its attempts, checkpoints, signals and waits,
and its idempotency key's reservation. Each queue says how long to keep them
(``configure_queue(..., terminal_retention_seconds=, idempotency_retention_seconds=)``; a
queue without settings keeps finished tasks 7 days and reservations 30 days), and retention
deletes what is older, in bounded batches:

* **finished tasks** (succeeded, failed, cancelled) whose ``completed_at`` is older than the
  queue's terminal retention, oldest first, a task only once its whole family (root and all
  descendants) is finished and past its retention: a family goes as a whole, in one
  statement, never split by the batch size;
* **idempotency reservations** that expired: a reservation lives until its task finished
  more than the queue's idempotency retention ago, whether or not the task row still
  exists. An unexpired reservation is never deleted, whatever happens to its task;
* **worker rows** that expired longer than ``worker_retention`` ago (only when no ``queue``
  is given: workers serve several queues).

Each batch is one short statement in its own transaction that skips rows other transactions
hold (``SKIP LOCKED``; a batch that fails on a row it cannot skip, a history row the cascade
must delete, is retried one task at a time, and the task that fails alone is set aside with a
warning; a kind whose statement is cut short anyway ends for the run with a warning, and the
other kinds go on), so concurrent runs (every worker runs retention on an interval, an
operator runs ``pgtask retention run``) share the work, each row deleted once. Retention locks
only finished tasks and reservations, never a task a claim could take, so it never holds up a
claim however slow it is. See ``docs/retention.md``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Engine, Executable, Row, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._connection import async_engine, sync_engine, translated_errors
from sqlalchemy_pgtask._failures import brief, held_back
from sqlalchemy_pgtask._prepared import unprepared, unprepared_async
from sqlalchemy_pgtask.statements import retention as retention_statements
from sqlalchemy_pgtask.validation import (
    INT4_MAX,
    check_int_range,
    check_queue_name,
    check_seconds,
)

__all__ = [
    "BATCH_SIZE_MAX",
    "WORKER_RETENTION_SECONDS",
    "RetentionResult",
    "RetentionSweep",
    "run_retention",
    "run_retention_async",
]

logger = logging.getLogger("sqlalchemy_pgtask.retention")

#: The largest batch one statement deletes.
BATCH_SIZE_MAX: Final = 100_000
#: How long a stopped or vanished worker's row is kept by default (`WorkerOptions`' default).
WORKER_RETENTION_SECONDS: Final = 3600.0
#: Retention's statements see the latest commits: a row another run deleted is not seen again.
_ISOLATION: Final = "READ COMMITTED"

#: One batch: a statement and its parameters; the driver sends back the rows it returned.
Step = tuple[Executable, dict[str, Any]]

#: A ``lock_timeout`` for a run whose connection has none (0: wait for ever): a batch held
#: up by a row another transaction holds fails after this, and its tasks go one at a time.
_RUN_LOCK_TIMEOUT: Final = "5s"
#: And without JIT, as on a worker's connections: the family walks' row estimates put a batch
#: above ``jit_optimize_above_cost``, and compiling it cost about a second per batch (measured
#: with ``benchmarks/retention_chain.py``) for a statement that runs in milliseconds.
_BOUNDED: Final = text(
    "SELECT set_config('jit', 'off', true),"
    " CASE WHEN current_setting('lock_timeout') IN ('0', '0ms', '0s')"
    " THEN set_config('lock_timeout', :timeout, true) END"
).bindparams(timeout=_RUN_LOCK_TIMEOUT)


def is_held(exc: BaseException) -> bool:
    """Whether a retention statement failed on a row another transaction holds.

    The driver of a `RetentionSweep` throws such a failure into `RetentionSweep.steps`
    (after rolling its transaction back), which works around the row; any other it raises.
    """
    return isinstance(exc, DBAPIError) and held_back(exc) is not None


@dataclass(frozen=True, slots=True)
class RetentionResult:
    """What one retention run deleted."""

    #: Finished tasks deleted (their attempts, checkpoints, signals and waits with them).
    tasks_deleted: int = 0
    #: Idempotency reservations deleted (their keys may be used again).
    keys_deleted: int = 0
    #: Rows of workers long gone.
    workers_deleted: int = 0
    #: Deleting statements run, each in its own transaction.
    batches: int = 0
    #: Whether some kind stopped at ``max_batches`` with work possibly left (run it again).
    stopped_early: bool = False
    #: The kinds a statement of which was cut short (a lock, a timeout: a warning says which),
    #: each ended for this run, work possibly left; the other kinds went on.
    kinds_cut_short: tuple[str, ...] = ()


class RetentionSweep:
    """The batches of one run (or one worker pass), as statements to execute; no I/O.

    `steps` yields each statement with its parameters and expects the rows it returned back
    (``generator.send(rows)``); the caller runs each in a transaction of its own. At most
    ``max_batches`` batches of each kind run (None: until done). The finished-keys cursors
    (per queue, the completion time read up to) may be shared by successive sweeps, so a
    worker reads each finished task once rather than once per pass. ``skip``: roots to leave
    out (set aside by earlier passes); ``rest(root)`` is called for each root set aside now and
    says in the warning when it is tried again.
    """

    def __init__(
        self,
        *,
        queue: str | None,
        batch_size: int,
        max_batches: int | None,
        worker_retention: float | None,
        cursors: dict[str, datetime] | None = None,
        skip: Collection[uuid.UUID] = (),
        rest: Callable[[uuid.UUID], str] | None = None,
    ) -> None:
        self._queue = queue
        self._batch = batch_size
        self._max = max_batches
        self._worker_retention = worker_retention
        self.cursors: dict[str, datetime] = {} if cursors is None else cursors
        self.tasks_deleted = 0
        self.keys_deleted = 0
        self.workers_deleted = 0
        self.batches = 0
        #: Whether some kind stopped at ``max_batches`` with work possibly left.
        self.cut_short = False
        #: Roots left out: ``skip``, and those whose deletion failed alone (a row held by
        #: another transaction), never taken again by this sweep.
        self.set_aside: set[uuid.UUID] = set(skip)
        self._rest = rest
        #: Kinds a statement of which was cut short (by what): the others went on.
        self.failed: dict[str, str] = {}

    def result(self) -> RetentionResult:
        return RetentionResult(
            tasks_deleted=self.tasks_deleted,
            keys_deleted=self.keys_deleted,
            workers_deleted=self.workers_deleted,
            batches=self.batches,
            stopped_early=self.cut_short,
            kinds_cut_short=tuple(self.failed),
        )

    def _more(self, done: int) -> bool:
        if self._max is None or done < self._max:
            return True
        self.cut_short = True
        return False

    def steps(self) -> Generator[Step, Sequence[Row[Any]], None]:
        kinds: list[tuple[str, Callable[[], Generator[Step, Sequence[Row[Any]], None]]]] = [
            ("finished tasks", self._tasks),
            ("expired idempotency keys", self._expired_keys),
            ("idempotency keys of tasks finished long ago", self._finished_keys),
        ]
        if self._worker_retention is not None:
            kinds.append(("worker rows", self._workers))
        for kind, run in kinds:
            try:
                yield from run()
            except DBAPIError as exc:
                if not is_held(exc):
                    raise
                # A statement cut short (a lock, statement_timeout on a huge family walk)
                # would fail it again on every pass: it must not keep the later kinds from
                # ever running.
                self.failed[kind] = brief(exc)
                logger.warning(
                    "retention of %s stopped for this pass: a statement was cut short (%s);"
                    " the other kinds go on, a later pass tries again", kind, brief(exc),
                )

    def _tasks(self) -> Generator[Step, Sequence[Row[Any]], None]:
        done = 0
        while self._more(done):
            params = {"queue": self._queue, "limit": self._batch, "skip": sorted(self.set_aside)}
            try:
                rows = yield (retention_statements.DELETE_FINISHED_TASKS, params)
            except DBAPIError as exc:
                if not is_held(exc):
                    raise
                # One row another transaction holds (a history row the cascade must delete)
                # failed the whole batch, and the next would take the same: one at a time.
                done += 1
                self.batches += 1
                yield from self._one_at_a_time(params)
                continue
            done += 1
            self.batches += 1
            self.tasks_deleted += len(rows)
            # Families go whole: a batch short of its size found no more (for now).
            if len(rows) < self._batch:
                return

    def _one_at_a_time(self, params: dict[str, Any]) -> Generator[Step, Sequence[Row[Any]], None]:
        """The failed batch's families, each alone; one that fails alone is set aside."""
        candidates = yield (retention_statements.FINISHED_TASK_CANDIDATES, params)
        for (task_id,) in candidates:
            try:
                rows = yield (
                    retention_statements.DELETE_FINISHED_TASK,
                    {"task_id": task_id, "queue": self._queue},
                )
            except DBAPIError as exc:
                if not is_held(exc):
                    raise
                self.set_aside.add(task_id)
                logger.warning(
                    "retention passed over task %s: deleting it (with its family) failed (%s), a"
                    " row of the family or of its history is held by another transaction; %s",
                    task_id, brief(exc),
                    "a later run tries again" if self._rest is None else self._rest(task_id),
                )
                continue
            self.tasks_deleted += len(rows)

    def _expired_keys(self) -> Generator[Step, Sequence[Row[Any]], None]:
        done = 0
        while self._more(done):
            rows = yield (
                retention_statements.DELETE_EXPIRED_KEYS,
                {"queue": self._queue, "limit": self._batch},
            )
            done += 1
            self.batches += 1
            self.keys_deleted += len(rows)
            if len(rows) < self._batch:
                return

    def _finished_keys(self) -> Generator[Step, Sequence[Row[Any]], None]:
        done = 0
        if not self._more(done):
            return
        queues = yield (
            retention_statements.FINISHED_QUEUES,
            {
                "queue": self._queue,
                "cursor_queues": list(self.cursors),
                "cursor_afters": list(self.cursors.values()),
            },
        )
        for policy in queues:
            while self._more(done):
                (row,) = yield (
                    retention_statements.DELETE_FINISHED_KEYS,
                    {
                        "queue": policy.queue,
                        "after": self.cursors.get(policy.queue),
                        "scan_limit": self._batch,
                    },
                )
                done += 1
                self.batches += 1
                self.keys_deleted += row.deleted
                if row.reached is not None:
                    self.cursors[policy.queue] = row.reached
                if row.scanned < self._batch:
                    break

    def _workers(self) -> Generator[Step, Sequence[Row[Any]], None]:
        done = 0
        while self._more(done):
            rows = yield (
                statements.PRUNE_WORKERS,
                {"retention_seconds": self._worker_retention, "limit": self._batch},
            )
            done += 1
            self.batches += 1
            self.workers_deleted += len(rows)
            if len(rows) < self._batch:
                return


def _sweep(
    queue: str | None, batch_size: int, max_batches: int | None, worker_retention: float
) -> RetentionSweep:
    """The run's sweep, its options validated before any SQL."""
    if queue is not None:
        check_queue_name(queue)
    check_int_range("batch_size", batch_size, 1, BATCH_SIZE_MAX)
    if max_batches is not None:
        check_int_range("max_batches", max_batches, 1, INT4_MAX)
    retention = check_seconds("worker_retention", worker_retention)
    return RetentionSweep(
        queue=queue,
        batch_size=batch_size,
        max_batches=max_batches,
        worker_retention=retention if queue is None else None,
    )


def run_retention(
    engine: Engine,
    *,
    queue: str | None = None,
    batch_size: int = 1000,
    max_batches: int | None = None,
    worker_retention: float = WORKER_RETENTION_SECONDS,
) -> RetentionResult:
    """Delete expired history now, batch after batch, until none is left; returns the counts.

    Takes an engine, not a session: each batch (at most ``batch_size`` rows) commits in a
    short READ COMMITTED transaction of its own, on one connection of ``engine``, so a long
    run never holds locks or an old snapshot, and what it deleted stays deleted if it is
    interrupted. Each kind (finished tasks, expired reservations, reservations of tasks
    finished long ago, worker rows) runs until a batch comes back short, ``max_batches``
    batches of that kind ran, or one of its statements was cut short (a lock, a timeout: a
    warning, and `RetentionResult.kinds_cut_short`). A workflow family goes whole in one
    batch (a batch may exceed ``batch_size`` by the last family's size less one); with
    ``queue``, only the families whose members are all in that queue.

    ``queue`` limits tasks and reservations to that queue, and leaves worker rows alone;
    ``worker_retention`` is how long after it expired a worker row is kept (seconds).
    Safe to run while workers run, and while other runs run: they skip each other's rows.

    :raises ValidationError: a bad option, before any SQL.
    :raises SchemaNotInstalled: the database has no pgtask schema.
    """
    target = sync_engine(engine, "run_retention")
    sweep = _sweep(queue, batch_size, max_batches, worker_retention)
    steps = sweep.steps()
    with translated_errors(), target.connect() as connection:
        connection = connection.execution_options(isolation_level=_ISOLATION)
        try:
            step = next(steps)
            while True:
                try:
                    with connection.begin(), unprepared(connection):
                        connection.execute(_BOUNDED)
                        rows = connection.execute(*step).all()
                except DBAPIError as exc:
                    if not is_held(exc):
                        raise
                    step = steps.throw(exc)
                    continue
                step = steps.send(rows)
        except StopIteration:
            pass
    return sweep.result()


async def run_retention_async(
    engine: AsyncEngine,
    *,
    queue: str | None = None,
    batch_size: int = 1000,
    max_batches: int | None = None,
    worker_retention: float = WORKER_RETENTION_SECONDS,
) -> RetentionResult:
    """`run_retention` for an `AsyncEngine`; the same batches and guarantees."""
    target = async_engine(engine, "run_retention")
    sweep = _sweep(queue, batch_size, max_batches, worker_retention)
    steps = sweep.steps()
    with translated_errors():
        async with target.connect() as connection:
            connection = await connection.execution_options(isolation_level=_ISOLATION)
            try:
                step = next(steps)
                while True:
                    try:
                        async with connection.begin(), unprepared_async(connection):
                            await connection.execute(_BOUNDED)
                            rows = (await connection.execute(*step)).all()
                    except DBAPIError as exc:
                        if not is_held(exc):
                            raise
                        step = steps.throw(exc)
                        continue
                    step = steps.send(rows)
            except StopIteration:
                pass
    return sweep.result()
