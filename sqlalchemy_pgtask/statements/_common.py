"""statements._common: the tables, database time and the lease-request rows every statement shares.

Private to the statements package; performs no I/O.
"""

from __future__ import annotations

import typing
import uuid
from typing import Any, Final, NamedTuple

from sqlalchemy import (
    ColumnElement,
    Table,
    TableValuedAlias,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID
from sqlalchemy.types import TypeEngine

from sqlalchemy_pgtask.models import (
    Attempt,
    Checkpoint,
    HandlerPolicy,
    IdempotencyKey,
    Queue,
    RateBucket,
    Signal,
    Task,
    Wait,
    WorkerCapability,
    WorkerRecord,
)
from sqlalchemy_pgtask.states import RUNNING

__all__ = [
    "CANCELLED_ERROR",
    "NOW",
    "TSTZ",
    "UUID_T",
    "Lease",
    "arrays",
    "attempts",
    "capabilities",
    "checkpoints",
    "keys",
    "not_aside",
    "policies",
    "queues",
    "rate_buckets",
    "running_state",
    "seconds",
    "signals",
    "tasks",
    "waits",
    "workers",
]

# Declarative tables are typed as FromClause; these are plain Tables.
tasks = typing.cast(Table, Task.__table__)
attempts = typing.cast(Table, Attempt.__table__)
keys = typing.cast(Table, IdempotencyKey.__table__)
queues = typing.cast(Table, Queue.__table__)
rate_buckets = typing.cast(Table, RateBucket.__table__)
workers = typing.cast(Table, WorkerRecord.__table__)
capabilities = typing.cast(Table, WorkerCapability.__table__)
policies = typing.cast(Table, HandlerPolicy.__table__)
checkpoints = typing.cast(Table, Checkpoint.__table__)
signals = typing.cast(Table, Signal.__table__)
waits = typing.cast(Table, Wait.__table__)

TSTZ: Final = TIMESTAMP(timezone=True)
UUID_T: Final = UUID(as_uuid=True)

#: The error document of a task cancelled while it was not running.
CANCELLED_ERROR: Final[ColumnElement[Any]] = cast(
    literal_column("""'{"type": "cancelled"}'"""), JSONB
)

#: Database time, the one clock of every deadline: ``pgtask.now()`` is ``statement_timestamp()``
#: (inlined by the planner, so it costs nothing), and tests replace its body to move the clock
#: of the whole database at once (``sqlalchemy_pgtask.testing.move_database_clock``).
NOW: Final[ColumnElement[Any]] = func.pgtask.now(type_=TSTZ)


class Lease(NamedTuple):
    """What fences every write of a running attempt: the task, its attempt number and token."""

    task_id: uuid.UUID
    attempt: int
    token: uuid.UUID


def seconds(value: ColumnElement[Any]) -> ColumnElement[Any]:
    """An interval of ``value`` seconds (``make_interval``'s positional form has no binds)."""
    return func.make_interval(*([literal_column("0")] * 6), value)


def arrays(
    name: str, *columns: tuple[str, str, TypeEngine[Any]]
) -> TableValuedAlias:
    """Parallel array parameters ``(param, column, type)`` as the rows of ``unnest``."""
    return (
        func.unnest(*(bindparam(param, type_=ARRAY(type_)) for param, _, type_ in columns))
        .table_valued(*(column(col, type_) for _, col, type_ in columns))
        .render_derived(name)
    )


def not_aside(task_id: ColumnElement[Any]) -> ColumnElement[bool]:
    """``task_id`` is none of the tasks bound as ``aside`` (default none): those a
    maintenance pass set aside for now (`worker._set_aside`)."""
    return task_id != func.all(bindparam("aside", [], type_=ARRAY(UUID_T)))


def running_state() -> ColumnElement[Any]:
    """``'running'`` for a fence, as a bound value read through a scalar subquery.

    A literal ``'running'`` would match the partial lease index, and a plan could then walk
    every running row (and every dead entry not yet vacuumed) instead of probing the primary
    key; not even a custom plan can match this form to the index predicate. Callers never
    pass ``running``: its default applies.
    """
    return select(bindparam("running", RUNNING, type_=Text)).scalar_subquery()
