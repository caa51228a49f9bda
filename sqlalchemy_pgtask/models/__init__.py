"""models: the one declarative definition of the pgtask schema; never creates or alters tables.

Every table lives in the PostgreSQL schema ``pgtask`` and belongs to `metadata`, which carries a
naming convention so constraint names are stable across the models and the Alembic revisions.
The shipped revisions (``sqlalchemy_pgtask/migrations``) install this schema; a drift test
applies them to an empty database and compares the result with these models. Install with
``alembic upgrade heads`` or ``pgtask migrate``, never with ``metadata.create_all``: the
triggers that keep invariants for every writer exist only in the revisions.

The mapped classes are ordinary SQLAlchemy models: query and join them from your own session.
Write to them only through the library's functions, which keep the state machine and the
fencing rules.
"""

from __future__ import annotations

from sqlalchemy_pgtask.models._base import SCHEMA, Base, metadata
from sqlalchemy_pgtask.models._durable import Checkpoint, Signal, Wait
from sqlalchemy_pgtask.models._operations import AuditEntry, Schedule
from sqlalchemy_pgtask.models._queues import CapacityRelease, IdempotencyKey, Queue, RateBucket
from sqlalchemy_pgtask.models._tasks import Attempt, Task
from sqlalchemy_pgtask.models._workers import HandlerPolicy, WorkerCapability, WorkerRecord
from sqlalchemy_pgtask.states import ACTIVE_STATES, ATTEMPT_STATES, TASK_STATES, TERMINAL_STATES

__all__ = [
    "ACTIVE_STATES",
    "ATTEMPT_STATES",
    "SCHEMA",
    "TASK_STATES",
    "TERMINAL_STATES",
    "Attempt",
    "AuditEntry",
    "Base",
    "CapacityRelease",
    "Checkpoint",
    "HandlerPolicy",
    "IdempotencyKey",
    "Queue",
    "RateBucket",
    "Schedule",
    "Signal",
    "Task",
    "Wait",
    "WorkerCapability",
    "WorkerRecord",
    "metadata",
]
