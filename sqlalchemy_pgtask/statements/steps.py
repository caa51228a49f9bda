"""statements.steps: checkpoints, durable sleep and child spawning; no I/O.

Every write a durable call of a running handler makes is fenced like an outcome: it matches
the task id, the running state, the attempt number and the lease token, and locks a row so the
lease cannot change before the write commits (a checkpoint: the attempt's row, which renewals
never touch; a sleep or a spawn: the task row, which they update anyway). A checkpoint's key
is (task, handler version, step, occurrence); the first committed value wins and is never
changed. A sleep ends the attempt as ``suspended`` in the statement that records it: the lease
is cleared, so the worker's slot is free at once, and a suspension never counts as a failed
attempt.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    Double,
    Integer,
    Select,
    SmallInteger,
    Text,
    case,
    cast,
    false,
    func,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from sqlalchemy_pgtask.statements._common import (
    NOW,
    TSTZ,
    UUID_T,
    attempts,
    checkpoints,
    running_state,
    seconds,
    tasks,
)
from sqlalchemy_pgtask.statements._fence import (
    CHECKPOINT_KEY,
    KEEP_FIRST,
    bind,
    const,
    fenced,
    has_rows,
    is_key,
    key_binds,
    suspend,
    task_bind,
)

__all__ = ["CHECKPOINT", "CHECKPOINTS", "FENCE_STATE", "SAVE_CHECKPOINT", "SLEEP", "SPAWN"]


# -- checkpoints ---------------------------------------------------------------------------

_SLEEP_AHEAD: Final = case(
    (
        checkpoints.c.kind == const("sleep"),
        cast(checkpoints.c.value.op("->>")(const("wake_at")), TSTZ) > NOW,
    ),
    else_=false(),
)

#: Every checkpoint of one task's handler version, read once when an attempt replays.
#: Locks nothing; served by the primary key. Binds ``task``, ``handler_version``. Returns
#: ``(step, occurrence, kind, value, asleep)``; ``asleep``: a sleep whose wake time is still
#: ahead in database time (the task was retried or woken early), which must sleep again.
CHECKPOINTS: Final = select(
    checkpoints.c.step, checkpoints.c.occurrence, checkpoints.c.kind, checkpoints.c.value,
    _SLEEP_AHEAD.label("asleep"),
).where(
    checkpoints.c.task_id == task_bind(),
    checkpoints.c.version == bind("handler_version", Integer),
)

#: One checkpoint's kind and value, or no row. Locks nothing. Binds the key of `DurableParams`.
CHECKPOINT: Final = select(checkpoints.c.kind, checkpoints.c.value).where(is_key())

#: The lease state of one task, read when a fenced durable write matched nothing: this attempt
#: lost its lease, or (for suspending calls) its cancellation was requested. Locks nothing.
#: Binds ``task``; returns ``(state, attempt, lease_token, cancel)``.
FENCE_STATE: Final = select(
    tasks.c.state,
    tasks.c.attempt,
    tasks.c.lease_token,
    tasks.c.cancel_requested_at.is_not(None).label("cancel"),
).where(tasks.c.id == task_bind())


def _save_checkpoint() -> Select[Any]:
    # The lock is on the attempt's row, which only the end of the attempt changes (complete,
    # fail, release, suspend, recovery): a renewal never waits for it, and a transaction at
    # REPEATABLE READ (``ctx.transaction`` on such an engine) is not failed by renewals that
    # changed the task row after its snapshot.
    fence = (
        fenced(tasks.c.id)
        .join_from(tasks, attempts, attempts.c.task_id == tasks.c.id)
        .where(
            attempts.c.task_id == task_bind(),
            attempts.c.attempt == bind("attempt_number", Integer),
            attempts.c.lease_token == bind("token", UUID_T),
            attempts.c.state == running_state(),
        )
        .with_for_update(read=True, of=attempts)
        .cte("fence")
    )
    saved = (
        pg_insert(checkpoints)
        .from_select(
            [*CHECKPOINT_KEY, "kind", "value"],
            select(
                fence.c.id, *key_binds()[1:], bind("kind", Text), cast(bind("value", Text), JSONB)
            ),
        )
        .on_conflict_do_nothing(index_elements=list(CHECKPOINT_KEY))
        .returning(checkpoints.c.value.label("stored"))
        .cte("saved")
    )
    return select(
        has_rows(fence).label("held"),
        has_rows(saved).label("saved"),
        select(saved.c.stored).scalar_subquery().label("stored"),
    )


#: Stores a checkpoint (``kind``, ``value`` as JSON text) if this attempt still holds its lease
#: and the key is free. Locks the attempt's row ``FOR SHARE`` until commit, so the attempt
#: cannot end (nor the task be claimed again) before the write commits. Returns ``(held,
#: saved, stored)``: ``stored`` is the value as ``jsonb`` keeps it (key order and numbers as
#: a replay reads them back, decoded as the engine decodes JSON), None when nothing was saved;
#: ``saved`` false with ``held`` true means the key already had a value, which `CHECKPOINT`
#: then reads (the first committed value wins). Binds `DurableParams` plus ``kind`` and
#: ``value``.
SAVE_CHECKPOINT: Final = _save_checkpoint()


# -- sleep ---------------------------------------------------------------------------------


def _sleep() -> Select[Any]:
    wake = func.coalesce(bind("wake_at", TSTZ), NOW + seconds(bind("delay", Double)))
    fence = (
        fenced(tasks.c.id, wake.label("wake_at"))
        .where(tasks.c.cancel_requested_at.is_(None))
        .with_for_update(key_share=True)
        .cte("fence")
    )
    stored = (
        pg_insert(checkpoints)
        .from_select(
            [*CHECKPOINT_KEY, "kind", "value"],
            select(
                fence.c.id, *key_binds()[1:], const("sleep"),
                func.jsonb_build_object(const("wake_at"), fence.c.wake_at),
            ),
        )
        .on_conflict_do_update(**KEEP_FIRST)
        .returning(cast(checkpoints.c.value.op("->>")(const("wake_at")), TSTZ).label("wake_at"))
        .cte("stored")
    )
    wake_at = select(stored.c.wake_at).scalar_subquery()
    moved, recorded = suspend(fence, "pending", wake_at > NOW, run_at=wake_at)
    return select(
        has_rows(fence).label("held"), wake_at.label("wake_at"), has_rows(moved).label("suspended")
    ).add_cte(recorded)


#: A durable sleep until ``wake_at`` (a timestamp) or ``delay`` seconds of database time from
#: now (bind the other as None). Fenced; locks the task row (not when its cancellation was
#: requested: then nothing is written). Stores the wake time as the step's checkpoint (an
#: existing one wins: a replay sent again sleeps until the wake time first stored) and, if it
#: lies in the future, suspends the attempt: the task is pending again at the wake time.
#: Returns ``(held, wake_at, suspended)``. Binds `DurableParams`, ``wake_at``, ``delay``.
SLEEP: Final = _sleep()


# -- children ------------------------------------------------------------------------------


def _spawn() -> Select[Any]:
    fence = (
        fenced(tasks.c.id)
        .where(tasks.c.cancel_requested_at.is_(None))
        .with_for_update(key_share=True)
        .cte("fence")
    )
    earlier = select(checkpoints.c.value).where(is_key()).cte("earlier")
    child = (
        pg_insert(tasks)
        .from_select(
            ["id", "queue", "name", "version", "payload", "headers", "priority",
             "max_attempts", "run_at", "timeout_seconds", "parent_id", "concurrency_key",
             "concurrency_limit"],
            select(
                bind("child_id", UUID_T),
                bind("child_queue", Text),
                bind("child_name", Text),
                bind("child_version", Integer),
                cast(bind("child_payload", Text), JSONB),
                cast(bind("child_headers", Text), JSONB),
                bind("child_priority", SmallInteger),
                bind("child_max_attempts", Integer),
                func.coalesce(
                    bind("child_run_at", TSTZ), NOW + seconds(bind("child_delay", Double))
                ),
                bind("child_timeout", Double),
                fence.c.id,
                bind("child_concurrency_key", Text),
                bind("child_concurrency_limit", Integer),
            ).where(~has_rows(earlier)),
        )
        # A try whose first one still ran on a connection the client gave up on: that one
        # committed the child and its checkpoint, which the caller then reads.
        .on_conflict_do_nothing(index_elements=[tasks.c.id])
        .returning(tasks.c.id)
        .cte("child")
    )
    adopted = (
        pg_insert(checkpoints)
        .from_select(
            [*CHECKPOINT_KEY, "kind", "value"],
            select(
                *key_binds(), const("spawn"),
                func.jsonb_build_object(const("task_id"), child.c.id),
            ),
        )
        .on_conflict_do_nothing(index_elements=list(CHECKPOINT_KEY))
        .returning(checkpoints.c.task_id)
        .cte("adopted")
    )
    marked = (
        update(tasks)
        .where(tasks.c.id == task_bind(), has_rows(child), tasks.c.has_children.is_not(true()))
        .values(has_children=true())
        .cte("marked")
    )
    earlier_id = select(
        cast(earlier.c.value.op("->>")(const("task_id")), UUID_T)
    ).scalar_subquery()
    return select(
        has_rows(fence).label("held"),
        func.coalesce(earlier_id, select(child.c.id).scalar_subquery()).label("child_id"),
        has_rows(adopted).label("created"),
    ).add_cte(marked)


#: Creates a child task of this attempt's task, exactly once per step key: fenced (locks the
#: parent row; nothing when the parent's cancellation was requested); if the step's checkpoint
#: exists, returns the child it recorded; otherwise inserts the child (``parent_id`` set; the
#: queue's capacity applies) and its checkpoint ``{"task_id": child}`` together, and marks the
#: parent as having children. Returns ``(held, child_id, created)``; ``child_id`` is NULL when
#: an earlier try of this call committed after this statement's snapshot (read the checkpoint).
#: Binds `DurableParams` plus the child's ``id``, ``queue``, ``name``, ``version``,
#: ``payload``, ``headers``, ``priority``, ``max_attempts``, ``run_at``, ``delay``,
#: ``timeout`` (seconds or NULL: the handler's applies), ``concurrency_key``,
#: ``concurrency_limit``, each prefixed ``child_``.
SPAWN: Final = _spawn()
