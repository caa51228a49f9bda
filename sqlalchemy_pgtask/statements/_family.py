"""statements._family: whether a task's workflow family may go; for retention; no I/O."""

from __future__ import annotations

from typing import Final

from sqlalchemy import text

__all__ = ["DEFAULT_TERMINAL_RETENTION_SECONDS", "FREE_LEAF"]

#: A queue without a row keeps its finished tasks this long (7 days); the same default as
#: ``queues.terminal_retention_seconds``.
DEFAULT_TERMINAL_RETENTION_SECONDS: Final = 604_800


#: Whether candidate ``t`` is a leaf (no child left: a tree goes leaves first) and no member
#: of its family (its root, found through its ancestors, and all the root's descendants) is
#: kept: unfinished, or finished less than its own queue's terminal retention ago. A kept
#: member may still ask for a child's result (an unfinished one after a sleep or a retry, a
#: finished failed or cancelled one once an administrator retries it: its replay waits for
#: its children again), and so may any ancestor between it and the child: a child in a
#: short-retention queue that went first failed the replay ("not a direct child"). So the
#: family stays until every member is past its retention, and then goes leaves first.
#: Reads the family (``ix_tasks_parent`` and the primary key, one probe per member, stopping
#: at the first kept one); locks nothing, so a member another transaction holds holds up
#: nothing. ``UNION``: a ``parent_id`` cycle written by hand ends the walk. A task without a
#: parent (a root, an orphan) is its whole family once it has no child left. A CASE, so
#: that only a leaf walks its family (every inner member of a deep chain walking it again
#: in every batch made a 2,000-deep chain take more than five minutes). Each step of a walk
#: is a LATERAL ``OFFSET 0`` subquery, which the planner cannot flatten into a join: an index
#: probe per member, never a hash join over the whole table at every step.
FREE_LEAF: Final = text(f"""CASE
WHEN EXISTS (SELECT FROM pgtask.tasks AS child WHERE child.parent_id = t.id) THEN false
ELSE NOT EXISTS (
    WITH RECURSIVE up(id, parent_id) AS (
        SELECT a.id, a.parent_id FROM pgtask.tasks AS a WHERE a.id = t.parent_id
        UNION
        SELECT a.id, a.parent_id FROM up, LATERAL (
            SELECT a.id, a.parent_id FROM pgtask.tasks AS a WHERE a.id = up.parent_id OFFSET 0
        ) AS a
    ), family(id) AS (
        SELECT up.id FROM up WHERE up.parent_id IS NULL
        UNION
        SELECT c.id FROM family, LATERAL (
            SELECT c.id FROM pgtask.tasks AS c WHERE c.parent_id = family.id OFFSET 0
        ) AS c
    )
    SELECT FROM family
    JOIN pgtask.tasks AS m ON m.id = family.id
    LEFT JOIN pgtask.queues AS mq ON mq.name = m.queue
    WHERE m.state NOT IN ('succeeded', 'failed', 'cancelled')
       OR m.completed_at > pgtask.now() - make_interval(
           secs => coalesce(mq.terminal_retention_seconds, {DEFAULT_TERMINAL_RETENTION_SECONDS})))
END""")  # noqa: S608 (constants only)
