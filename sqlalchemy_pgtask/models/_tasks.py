"""models._tasks: tasks and their attempts, and a task's durable relations (read-only)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from sqlalchemy_pgtask.models._base import (
    FAST_AUTOVACUUM,
    NOW,
    Base,
    concurrency_key_check,
    concurrency_limit_check,
    positive_duration_check,
    quoted,
    retry_shape_check,
    size_check,
)
from sqlalchemy_pgtask.models._durable import Checkpoint, Wait, sleep_deadline
from sqlalchemy_pgtask.states import (
    ACTIVE_STATES,
    ATTEMPT_STATES,
    TASK_STATES,
    TERMINAL_STATES,
    AttemptState,
    TaskState,
)
from sqlalchemy_pgtask.validation import ERROR_MAX_BYTES

#: How a task's relations load when nothing asked for them: not at all. A lazy load would run
#: a query wherever the attribute is first touched: unnoticed N+1 queries in a sync session,
#: ``MissingGreenlet`` inside an `AsyncSession`. Instead an unloaded relation raises at once,
#: and `get_task` (or a loader option such as ``selectinload(Task.steps)``) loads them. Plain
#: queries of `Task` and the listings pay nothing; what needs no SQL (a parent already in the
#: session, or no parent id) is still answered.
_LOAD_EXPLICITLY: Final = "raise_on_sql"


class Task(Base):
    """One unit of work and its current state (history of each claim is in `Attempt`).

    Its durable relations (`steps`, `wait`, `children`, `parent`) are read-only views of rows
    the library writes, and are never loaded implicitly: `get_task` loads them all, or ask
    with loader options (``select(Task).options(selectinload(Task.children))``). Touching
    one that is not loaded raises instead of querying: `sqlalchemy.exc.InvalidRequestError`
    in a session, `sqlalchemy.orm.exc.DetachedInstanceError` outside one.
    """

    __tablename__ = "tasks"
    __table_args__ = (
        CheckConstraint(f"state IN ({quoted(TASK_STATES)})", name="state"),
        # The names, payload, headers, result and error are checked by row triggers that
        # fire only when those columns are written (revision pgtask_0008): PostgreSQL would
        # evaluate a CHECK on every update, re-printing the jsonb each claim and completion.
        CheckConstraint("version > 0", name="version"),
        CheckConstraint("attempt >= 0", name="attempt"),
        CheckConstraint("failed_attempts >= 0 AND failed_attempts <= attempt", name="failed"),
        CheckConstraint("max_attempts > 0", name="max_attempts"),
        # Unset until the first claim, which takes the registered handler's max_attempts.
        CheckConstraint("max_attempts IS NOT NULL OR attempt = 0", name="max_attempts_known"),
        CheckConstraint(
            "state <> 'running' OR (lease_token IS NOT NULL AND lease_owner IS NOT NULL"
            " AND lease_expires_at IS NOT NULL)",
            name="lease",
        ),
        CheckConstraint(
            f"(state IN ({quoted(TERMINAL_STATES)})) = (completed_at IS NOT NULL)",
            name="completed_at",
        ),
        CheckConstraint("parent_id IS NULL OR parent_id <> id", name="parent"),
        CheckConstraint(retry_shape_check(), name="retry_policy"),
        CheckConstraint(
            f"timeout_seconds IS NULL OR {positive_duration_check('timeout_seconds')}",
            name="timeout",
        ),
        CheckConstraint("(schedule_name IS NULL) = (scheduled_for IS NULL)", name="schedule"),
        CheckConstraint(concurrency_key_check(), name="concurrency_key"),
        CheckConstraint(concurrency_limit_check(), name="concurrency_limit"),
        CheckConstraint(
            "NOT concurrency_held OR concurrency_key IS NOT NULL", name="concurrency_held"
        ),
        # The claim path: due pending work of a queue, highest priority first.
        Index(
            "ix_tasks_claim",
            "queue", text("priority DESC"), "run_at", "id",
            postgresql_where=text("state = 'pending'"),
        ),
        # When the next scheduled task falls due, for an idle worker's sleep.
        Index(
            "ix_tasks_pending_run_at",
            "queue", "run_at",
            postgresql_where=text("state = 'pending'"),
        ),
        # Expired-lease recovery and lease renewal read only running rows.
        Index(
            "ix_tasks_lease_expiry",
            "lease_expires_at", "id",
            postgresql_where=text("state = 'running'"),
        ),
        # Outstanding work per queue: capacity recounts and the status command.
        Index(
            "ix_tasks_outstanding",
            "queue", "state",
            postgresql_where=text(f"state IN ({quoted(ACTIVE_STATES)})"),
        ),
        # Finished tasks of a queue, oldest first: retention's range, and status counts.
        Index(
            "ix_tasks_finished",
            "queue", "completed_at", "state",
            postgresql_where=text(f"state IN ({quoted(TERMINAL_STATES)})"),
        ),
        # The dashboard's task list: newest first by creation (database time), and a created
        # range read as one range of this index. ``id`` breaks ties for the keyset cursor.
        Index("ix_tasks_created", "created_at", "id"),
        Index(
            "ix_tasks_parent",
            "parent_id",
            postgresql_where=text("parent_id IS NOT NULL"),
        ),
        # Each occurrence of a schedule exists once, however many materialisers race.
        Index(
            "ix_tasks_schedule_occurrence",
            "schedule_name", "scheduled_for",
            unique=True,
            postgresql_where=text("schedule_name IS NOT NULL"),
        ),
        # The tasks holding a concurrency key (revision pgtask_0016): running, or suspended
        # with the key held. Tasks without a key are in neither of these two.
        Index(
            "ix_tasks_concurrency_holders",
            "queue", "name", "concurrency_key",
            postgresql_where=text(
                "concurrency_key IS NOT NULL AND (state = 'running' OR concurrency_held)"
            ),
        ),
        # A key's pending tasks in claim order: who is next for a free slot (FIFO per key).
        Index(
            "ix_tasks_concurrency_pending",
            "queue", "name", "concurrency_key", text("priority DESC"), "run_at", "id",
            postgresql_where=text("concurrency_key IS NOT NULL AND state = 'pending'"),
        ),
        # Tasks churn fast; vacuum and analyze long before the 20% defaults.
        {"postgresql_with": FAST_AUTOVACUUM},
    )

    id: Mapped[uuid.UUID] = mapped_column(
        primary_key=True, server_default=text("gen_random_uuid()")
    )
    queue: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    #: The handler version: a deploy can register a new version while old tasks drain.
    version: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    payload: Mapped[Any] = mapped_column(JSONB)
    headers: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    state: Mapped[TaskState] = mapped_column(Text, server_default=text("'pending'"))
    #: Higher runs first.
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    #: Earliest claim time, in database time.
    run_at: Mapped[datetime] = mapped_column(server_default=NOW)
    #: Number of claims so far, suspensions included; the attempt number of the current lease.
    attempt: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    #: Attempts that ended in failure; only these count against ``max_attempts``.
    failed_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    #: Failed attempts allowed; None until the first claim fills in the handler's default.
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    lease_token: Mapped[uuid.UUID | None]
    lease_owner: Mapped[uuid.UUID | None]
    lease_expires_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]
    #: A copy for display; uniqueness lives in `IdempotencyKey`, whose lifetime is its own.
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    result: Mapped[Any | None] = mapped_column(JSONB)
    error: Mapped[dict[str, Any] | None]
    parent_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("pgtask.tasks.id", ondelete="SET NULL")
    )
    #: Set when the task spawns its first child: only then does finishing it look for
    #: descendants to cancel (a plain task pays nothing for cascading cancellation).
    has_children: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    retry_kind: Mapped[str | None] = mapped_column(Text)
    retry_base_seconds: Mapped[float | None] = mapped_column(Double)
    retry_factor: Mapped[float | None] = mapped_column(Double)
    retry_max_seconds: Mapped[float | None] = mapped_column(Double)
    retry_jitter: Mapped[bool | None] = mapped_column(Boolean)
    #: Time limit of each attempt; None: the handler's own (or none).
    timeout_seconds: Mapped[float | None] = mapped_column(Double)
    #: The schedule and occurrence this task materialises; None for other tasks.
    schedule_name: Mapped[str | None] = mapped_column(Text)
    scheduled_for: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)
    updated_at: Mapped[datetime] = mapped_column(server_default=NOW)
    completed_at: Mapped[datetime | None]
    #: At most ``concurrency_limit`` tasks of one (queue, name, key) hold their key at once;
    #: None: not limited (docs/concurrency.md).
    concurrency_key: Mapped[str | None] = mapped_column(Text)
    #: This task's own limit for its key; None: its handler's (or 1).
    concurrency_limit: Mapped[int | None] = mapped_column(Integer)
    #: Whether the task keeps its key while a durable suspension (sleep, wait) runs nothing.
    concurrency_held: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))

    #: Every checkpoint the task's handler stored, oldest first.
    steps: Mapped[list[Checkpoint]] = relationship(
        order_by=lambda: (Checkpoint.created_at, Checkpoint.step, Checkpoint.occurrence),
        lazy=_LOAD_EXPLICITLY,
        viewonly=True,
    )
    #: What the task waits for while it is ``waiting`` (a signal or a child); None otherwise.
    #: A durable sleep is no wait (the task is ``pending``): see `sleeping_until`.
    wait: Mapped[Wait | None] = relationship(lazy=_LOAD_EXPLICITLY, viewonly=True)
    #: The tasks it spawned, oldest first.
    children: Mapped[list[Task]] = relationship(
        order_by=lambda: (Task.created_at, Task.id),
        lazy=_LOAD_EXPLICITLY,
        viewonly=True,
    )
    #: The task that spawned it; None for a task enqueued directly, or whose parent was deleted.
    parent: Mapped[Task | None] = relationship(
        remote_side=lambda: Task.id,
        lazy=_LOAD_EXPLICITLY,
        viewonly=True,
    )

    @property
    def sleeping_until(self) -> datetime | None:
        """The wake time of the durable sleep the task is in, or None; needs `steps` loaded.

        Asleep: ``pending``, the latest step a ``sleep`` whose stored wake time is ``run_at``
        (`sleep_deadline`). Python cannot know database time, so the wake time may already
        have passed: the task is then due and waits for a worker to claim it.
        """
        if not self.steps:
            return None
        latest = self.steps[-1]
        return sleep_deadline(self.state, self.run_at, latest.kind, latest.value)


class Attempt(Base):
    """Append-only history: one row per claim of a task."""

    __tablename__ = "attempts"
    __table_args__ = (
        CheckConstraint(f"state IN ({quoted(ATTEMPT_STATES)})", name="state"),
        CheckConstraint("attempt > 0", name="attempt"),
        CheckConstraint(
            f"error IS NULL OR {size_check('error', ERROR_MAX_BYTES)}", name="error_size"
        ),
        # Grows by one row per claim and is updated once per outcome: keep its statistics
        # fresh, or plans made while it was small keep scanning it sequentially.
        {"postgresql_with": FAST_AUTOVACUUM},
    )

    #: The task, with no foreign key (revision pgtask_0009): only the claim inserts attempt
    #: rows, in the statement that updates their tasks, and a foreign key's check locked each
    #: task once more. Deleting or truncating tasks deletes their attempts (triggers).
    task_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    lease_token: Mapped[uuid.UUID]
    worker_id: Mapped[uuid.UUID | None]
    state: Mapped[AttemptState] = mapped_column(Text, server_default=text("'running'"))
    started_at: Mapped[datetime] = mapped_column(server_default=NOW)
    finished_at: Mapped[datetime | None]
    #: When the attempt's time limit runs out (database time); None: no limit.
    deadline_at: Mapped[datetime | None]
    error: Mapped[dict[str, Any] | None]

