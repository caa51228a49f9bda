"""statements._family: whether a workflow family may go, and its members; for retention; no I/O."""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    FromClause,
    Integer,
    Select,
    column,
    func,
    or_,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.dml import ReturningDelete
from sqlalchemy.sql.selectable import TextualSelect

from sqlalchemy_pgtask.statements._common import UUID_T, keys, tasks

__all__ = [
    "DEFAULT_TERMINAL_RETENTION_SECONDS",
    "FREE_FAMILY",
    "families",
    "key_free",
    "members",
    "returning_delete",
]

#: A queue without a row keeps its finished tasks this long (7 days); the same default as
#: ``queues.terminal_retention_seconds``.
DEFAULT_TERMINAL_RETENTION_SECONDS: Final = 604_800

_TERMINAL: Final = "('succeeded', 'failed', 'cancelled')"


def _descendants(root: str) -> str:
    # Each step is a LATERAL ``OFFSET 0`` subquery, which the planner cannot flatten into a
    # join: one ix_tasks_parent probe per member, never a hash join over the whole table at
    # every level. ``UNION``: a ``parent_id`` cycle written by hand ends the walk.
    return f"""down(id) AS (
        SELECT c.id FROM pgtask.tasks AS c WHERE c.parent_id = {root}
        UNION
        SELECT c.id FROM down, LATERAL (
            SELECT c.id FROM pgtask.tasks AS c WHERE c.parent_id = down.id OFFSET 0
        ) AS c
    )"""  # noqa: S608 (constants only)


def _expired(m: str) -> str:
    return f"""{m}.state IN {_TERMINAL} AND {m}.completed_at <= pgtask.now() - make_interval(
        secs => coalesce((SELECT q.terminal_retention_seconds FROM pgtask.queues AS q
                          WHERE q.name = {m}.queue), {DEFAULT_TERMINAL_RETENTION_SECONDS}))"""  # noqa: S608


#: Whether no descendant of root candidate ``t`` (a task without a parent) is kept:
#: unfinished, or finished less than its own queue's terminal retention ago (``t`` itself is
#: the caller's to check). A kept member may still ask for a child's result (an unfinished
#: one after a sleep or a retry, a finished failed or cancelled one once an administrator
#: retries it: its replay waits for its children again), and so may any ancestor between it
#: and the child: a child in a short-retention queue that went first failed the replay ("not
#: a direct child"). So a family (a root and all its descendants) stays until every member is
#: past its retention, and then goes as a whole. Walks down from the root only (an index
#: probe per member, stopping at the first kept one); locks nothing. Only roots are
#: candidates, so a member of a kept family costs a batch an index entry read and passed
#: over, and a family is walked once per batch, not once per leaf.
FREE_FAMILY: Final = text(f"""NOT EXISTS (
    WITH RECURSIVE {_descendants("t.id")}
    SELECT FROM down, LATERAL (
        SELECT FROM pgtask.tasks AS m WHERE m.id = down.id AND NOT ({_expired("m")}) OFFSET 0
    ) AS kept
)""")  # noqa: S608 (constants only)


def members(root: str) -> TextualSelect:
    """The descendants of ``root`` (a column of the enclosing query) as one row: ``ids``
    (NULL: none), ``size``, and ``held``: how many of them this statement locked
    ``FOR UPDATE SKIP LOCKED`` and re-checked once locked (still finished and past their
    queue's retention, in the bound ``queue`` unless it is NULL, reservation free: locked
    ``FOR NO KEY UPDATE SKIP LOCKED``, as in `key_free`). The
    family may go only when ``held = size``: one member another transaction holds (or
    retried since the snapshot) keeps the family whole for a later batch, never split
    (deleting a parent without its child would set the child's ``parent_id`` to NULL).
    To be joined LATERAL; the walk is one index probe per member.
    """
    key_row = """FROM pgtask.idempotency_keys AS k
                 WHERE k.queue = m.queue AND k.key = m.idempotency_key AND k.task_id = m.id"""
    sql = f"""WITH RECURSIVE {_descendants(root)},
    held AS (
        SELECT h.id FROM down, LATERAL (
            SELECT m.id FROM pgtask.tasks AS m
            WHERE m.id = down.id AND {_expired("m")}
              AND (CAST(:queue AS text) IS NULL OR m.queue = CAST(:queue AS text))
              AND (m.idempotency_key IS NULL OR NOT EXISTS (SELECT {key_row})
                   OR EXISTS (SELECT {key_row} FOR NO KEY UPDATE SKIP LOCKED))
            FOR UPDATE OF m SKIP LOCKED
        ) AS h
    )
    SELECT array_agg(down.id) AS ids, count(*) AS size, (SELECT count(*) FROM held) AS held
    FROM down"""  # noqa: S608 (constants only)
    return text(sql).columns(
        column("ids", ARRAY(UUID_T)), column("size", Integer), column("held", Integer)
    )


def key_free(expired: FromClause) -> ColumnElement[bool]:
    # Deleting a keyed task writes its key's expiry down (tasks_idempotency_deleted): lock
    # that reservation here, skipping the task while a producer holds it (taking the key
    # over), so the trigger never waits for a producer nor a producer for this batch. Out
    # here, after the LATERAL's LIMIT, only the chosen tasks' reservations are locked, never
    # those of tasks kept for a child or a parent.
    k = keys.alias("k")
    reservation = select(k.c.key).where(
        k.c.queue == expired.c.queue,
        k.c.key == expired.c.idempotency_key,
        k.c.task_id == expired.c.id,
    )
    return or_(
        expired.c.idempotency_key.is_(None),
        ~reservation.exists(),
        reservation.with_for_update(key_share=True, skip_locked=True).exists(),
    )


def returning_delete(doomed: Select[Any]) -> ReturningDelete[Any]:
    # ANY(ARRAY(subquery)) probes the primary key once per row, whatever the plan. One
    # DELETE of a whole family is valid: tasks.parent_id's ON DELETE SET NULL runs at the
    # statement's end and finds the children deleted with their parent.
    return (
        tasks.delete()
        .where(tasks.c.id == func.any(func.array(doomed.scalar_subquery())))
        .returning(tasks.c.id, tasks.c.queue, tasks.c.parent_id)
    )


def families(chosen: FromClause, *, limit: ColumnElement[Any] | None) -> Select[Any]:
    """The ids of the chosen roots' families that may go whole, within ``limit`` tasks."""
    family = members("chosen.id").lateral("family")
    whole = (
        select(
            chosen.c.id,
            family.c.ids,
            (family.c.size + 1).label("size"),
            func.sum(family.c.size + 1)
            .over(order_by=[chosen.c.queue, chosen.c.completed_at, chosen.c.id], rows=(None, 0))
            .label("reached"),
        )
        .select_from(chosen.join(family, true()))
        .where(family.c.held == family.c.size)
        .subquery("whole")
    )
    ids = select(func.unnest(func.array_prepend(whole.c.id, whole.c.ids)))
    # A family is never split: the one that reaches the limit goes whole, the next waits.
    return ids if limit is None else ids.where(whole.c.reached - whole.c.size < limit)
