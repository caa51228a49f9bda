"""sqlalchemy-pgtask: durable tasks and workflows inside PostgreSQL and your SQLAlchemy session.

Enqueue inside your own transaction::

    from sqlalchemy_pgtask import enqueue

    with Session(engine) as session, session.begin():
        session.add(order)
        enqueue(session, "send-receipt", {"order_id": order.id})

The task commits or rolls back with the order. Install the schema with ``alembic upgrade
heads`` (see ``docs/alembic.md``) or ``pgtask migrate``, register handlers on a `Registry`,
and run them with ``pgtask worker app.tasks:registry``.
"""

from __future__ import annotations

from sqlalchemy_pgtask._version import __version__
from sqlalchemy_pgtask.admin import (
    pause_queue,
    pause_queue_async,
    resume_queue,
    resume_queue_async,
    retry,
    retry_async,
)
from sqlalchemy_pgtask.audit import AuditRecord, list_audit, list_audit_async
from sqlalchemy_pgtask.client import (
    cancel,
    cancel_async,
    get_task,
    get_task_async,
    wait_for_result,
    wait_for_result_async,
)
from sqlalchemy_pgtask.control import Fail, LeaseLost, Retry, Suspended, TaskCancelled
from sqlalchemy_pgtask.durable.context import BaseTaskContext, SyncTaskContext, TaskContext
from sqlalchemy_pgtask.durable.signals import emit_signal, emit_signal_async
from sqlalchemy_pgtask.durable.types import ChildResult, SyncTransactionStep, TransactionStep
from sqlalchemy_pgtask.enqueue import (
    EnqueueRequest,
    EnqueueResult,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from sqlalchemy_pgtask.errors import (
    DuplicateStep,
    IdempotencyConflict,
    InvalidNameError,
    InvalidOptionError,
    PayloadError,
    PgTaskError,
    PolicyConflict,
    QueueFull,
    ReplayMismatch,
    SchemaNotInstalled,
    TaskNotFound,
    TaskNotRetryable,
    TaskNotVisible,
    ValidationError,
    WorkerCrashed,
)
from sqlalchemy_pgtask.explain import Explanation, Reason, explain, explain_async
from sqlalchemy_pgtask.grants import grant_roles, grant_roles_async, grants_sql
from sqlalchemy_pgtask.models import (
    Attempt,
    AuditEntry,
    Checkpoint,
    HandlerPolicy,
    IdempotencyKey,
    Queue,
    RateBucket,
    Schedule,
    Signal,
    Task,
    Wait,
    WorkerCapability,
    WorkerRecord,
    metadata,
)
from sqlalchemy_pgtask.queues import (
    QueueSettings,
    configure_queue,
    configure_queue_async,
    list_queues,
    list_queues_async,
)
from sqlalchemy_pgtask.registry import DeclaredSchedule, Registry, TaskDefinition
from sqlalchemy_pgtask.retention import RetentionResult, run_retention, run_retention_async
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.schedule import (
    MaterializeReport,
    ScheduleInfo,
    ScheduleNotFound,
    delete_schedule,
    delete_schedule_async,
    get_schedule,
    get_schedule_async,
    list_schedules,
    list_schedules_async,
    materialize_schedules,
    materialize_schedules_async,
    pause_schedule,
    pause_schedule_async,
    resume_schedule,
    resume_schedule_async,
    run_schedule_now,
    run_schedule_now_async,
    set_schedule,
    set_schedule_async,
)
from sqlalchemy_pgtask.worker import Worker, WorkerOptions

__all__ = [
    "Attempt",
    "AuditEntry",
    "AuditRecord",
    "BaseTaskContext",
    "Checkpoint",
    "ChildResult",
    "DeclaredSchedule",
    "DuplicateStep",
    "EnqueueRequest",
    "EnqueueResult",
    "Explanation",
    "Fail",
    "HandlerPolicy",
    "IdempotencyConflict",
    "IdempotencyKey",
    "InvalidNameError",
    "InvalidOptionError",
    "LeaseLost",
    "MaterializeReport",
    "PayloadError",
    "PgTaskError",
    "PolicyConflict",
    "Queue",
    "QueueFull",
    "QueueSettings",
    "RateBucket",
    "Reason",
    "Registry",
    "ReplayMismatch",
    "RetentionResult",
    "Retry",
    "RetryPolicy",
    "Schedule",
    "ScheduleInfo",
    "ScheduleNotFound",
    "SchemaNotInstalled",
    "Signal",
    "Suspended",
    "SyncTaskContext",
    "SyncTransactionStep",
    "Task",
    "TaskCancelled",
    "TaskContext",
    "TaskDefinition",
    "TaskNotFound",
    "TaskNotRetryable",
    "TaskNotVisible",
    "TransactionStep",
    "ValidationError",
    "Wait",
    "Worker",
    "WorkerCapability",
    "WorkerCrashed",
    "WorkerOptions",
    "WorkerRecord",
    "__version__",
    "cancel",
    "cancel_async",
    "configure_queue",
    "configure_queue_async",
    "delete_schedule",
    "delete_schedule_async",
    "emit_signal",
    "emit_signal_async",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "explain",
    "explain_async",
    "get_schedule",
    "get_schedule_async",
    "get_task",
    "get_task_async",
    "grant_roles",
    "grant_roles_async",
    "grants_sql",
    "list_audit",
    "list_audit_async",
    "list_queues",
    "list_queues_async",
    "list_schedules",
    "list_schedules_async",
    "materialize_schedules",
    "materialize_schedules_async",
    "metadata",
    "pause_queue",
    "pause_queue_async",
    "pause_schedule",
    "pause_schedule_async",
    "resume_queue",
    "resume_queue_async",
    "resume_schedule",
    "resume_schedule_async",
    "retry",
    "retry_async",
    "run_retention",
    "run_retention_async",
    "run_schedule_now",
    "run_schedule_now_async",
    "set_schedule",
    "set_schedule_async",
    "wait_for_result",
    "wait_for_result_async",
]
