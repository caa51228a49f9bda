"""statements._fence: what every durable statement shares: the attempt's fence, the
checkpoint key, and the suspension of an attempt; no I/O.

No bind of the durable statements is named like a column of ``tasks`` or ``attempts``:
SQLAlchemy would add such a parameter to the SET list of the UPDATEs they contain.
"""

from __future__ import annotations

import uuid
from typing import Any, Final, TypedDict

from sqlalchemy import (
    CTE,
    BindParameter,
    ColumnElement,
    Integer,
    Select,
    Text,
    and_,
    bindparam,
    case,
    exists,
    false,
    func,
    literal_column,
    null,
    select,
    true,
    update,
)

from sqlalchemy_pgtask.statements._common import (
    NOW,
    UUID_T,
    Lease,
    attempts,
    checkpoints,
    policies,
    running_state,
    tasks,
)

__all__ = [
    "CHECKPOINT_KEY",
    "KEEP_FIRST",
    "DurableParams",
    "bind",
    "const",
    "durable_params",
    "fenced",
    "has_rows",
    "is_key",
    "key_binds",
    "states",
    "suspend",
    "task_bind",
]

CHECKPOINT_KEY: Final = ("task_id", "version", "step", "occurrence")
#: ``ON CONFLICT`` arguments that keep a checkpoint's first value and return it: the update
#: takes the row lock and changes nothing.
KEEP_FIRST: Final[dict[str, Any]] = {
    "index_elements": list(CHECKPOINT_KEY), "set_": {"value": checkpoints.c.value},
}


class DurableParams(TypedDict):
    """The fence of one attempt and the checkpoint key of one durable call.

    No bind of this module is named like a column of ``tasks`` or ``attempts``: SQLAlchemy
    would add such a parameter to the SET list of the UPDATEs these statements contain.
    """

    task: uuid.UUID
    attempt_number: int
    token: uuid.UUID
    handler_version: int
    step: str
    occurrence: int


def durable_params(lease: Lease, version: int, step: str, occurrence: int) -> DurableParams:
    return {
        "task": lease.task_id, "attempt_number": lease.attempt, "token": lease.token,
        "handler_version": version, "step": step, "occurrence": occurrence,
    }


def bind(name: str, type_: Any) -> BindParameter[Any]:
    return bindparam(name, type_=type_)


def task_bind() -> ColumnElement[Any]:
    return bind("task", UUID_T)


def fenced(*columns: ColumnElement[Any]) -> Select[Any]:
    """The task row while this attempt holds its lease (lock it with the caller's mode)."""
    return select(*columns).where(
        tasks.c.id == task_bind(),
        tasks.c.state == running_state(),
        tasks.c.attempt == bind("attempt_number", Integer),
        tasks.c.lease_token == bind("token", UUID_T),
    )


def key_binds() -> list[ColumnElement[Any]]:
    """The checkpoint key bound by `DurableParams`, in the order of ``CHECKPOINT_KEY``."""
    return [
        task_bind(),
        bind("handler_version", Integer),
        bind("step", Text),
        bind("occurrence", Integer),
    ]


def is_key(table: Any = checkpoints) -> ColumnElement[bool]:
    task_id, version, step, occurrence = key_binds()
    return and_(
        table.c.task_id == task_id,
        table.c.version == version,
        table.c.step == step,
        table.c.occurrence == occurrence,
    )


def has_rows(cte: CTE) -> ColumnElement[Any]:
    return exists(select(literal_column("1")).select_from(cte))


def const(value: str) -> ColumnElement[Any]:
    """A text constant written into the SQL, not bound: the plan and the cache key stay one."""
    return literal_column(f"'{value}'", Text)


def states(names: tuple[str, ...]) -> list[ColumnElement[Any]]:
    return [const(name) for name in names]


def _keeps_key() -> ColumnElement[bool]:
    """Whether a suspended task keeps its concurrency key: it has one, and its handler's
    frozen scope is ``workflow`` (the default, also without a policy row). A CASE, so a task
    without a key never reads the policy."""
    p = policies
    scope = (
        select(p.c.concurrency_scope == const("workflow"))
        .where(p.c.queue == tasks.c.queue, p.c.name == tasks.c.name,
               p.c.version == tasks.c.version)
        .scalar_subquery()
    )
    return case((tasks.c.concurrency_key.is_(None), false()), else_=func.coalesce(scope, true()))


def suspend(fence: CTE, state: str, when: ColumnElement[bool], **values: Any) -> tuple[CTE, CTE]:
    """End the fenced attempt as suspended, the task in ``state``: its lease is cleared, and
    its concurrency key kept or released (`_keeps_key`)."""
    moved = (
        update(tasks)
        .where(tasks.c.id == task_bind(), has_rows(fence), when)
        .values(
            state=const(state), lease_token=null(), lease_owner=null(), lease_expires_at=null(),
            updated_at=NOW, concurrency_held=_keeps_key(), **values,
        )
        .returning(tasks.c.id)
        .cte(f"{state}_task")
    )
    recorded = (
        update(attempts)
        .where(
            attempts.c.task_id == task_bind(),
            attempts.c.attempt == bind("attempt_number", Integer),
            has_rows(moved),
        )
        .values(state=const("suspended"), finished_at=NOW)
        .cte("suspended_attempt")
    )
    return moved, recorded
