"""statements._family: whether a task's workflow family may go; for retention; no I/O."""

from __future__ import annotations

from typing import Final

from sqlalchemy import text

__all__ = ["DEFAULT_TERMINAL_RETENTION_SECONDS", "FAMILY_KEPT"]

#: A queue without a row keeps its finished tasks this long (7 days); the same default as
#: ``queues.terminal_retention_seconds``.
DEFAULT_TERMINAL_RETENTION_SECONDS: Final = 604_800


#: Whether no member of the family of candidate ``t`` (its root, found through its
#: ancestors, and all the root's descendants) is kept: unfinished, or finished less than its
#: own queue's terminal retention ago. A kept member may still ask for a child's result (an
#: unfinished one after a sleep or a retry, a finished failed or cancelled one once an
#: administrator retries it: its replay waits for its children again), and so may any
#: ancestor between it and the child: a child in a short-retention queue that went first
#: failed the replay ("not a direct child"). So the family stays until every member is past
#: its retention, and then goes leaves first. Reads the family (``ix_tasks_parent`` and the
#: primary key, one probe per member, stopping at the first kept one); locks nothing, so a
#: member held by another transaction holds up nothing. ``UNION``: a ``parent_id`` cycle
#: written by hand ends the walk. A task without a parent (a root, an orphan) is its whole
#: family once it has no child left.
FAMILY_KEPT: Final = text(f"""NOT EXISTS (
    WITH RECURSIVE up(id, parent_id) AS (
        SELECT a.id, a.parent_id FROM pgtask.tasks AS a WHERE a.id = t.parent_id
        UNION
        SELECT a.id, a.parent_id FROM pgtask.tasks AS a JOIN up ON a.id = up.parent_id
    ), family(id) AS (
        SELECT up.id FROM up WHERE up.parent_id IS NULL
        UNION
        SELECT c.id FROM pgtask.tasks AS c JOIN family ON c.parent_id = family.id
    )
    SELECT FROM family
    JOIN pgtask.tasks AS m ON m.id = family.id
    LEFT JOIN pgtask.queues AS mq ON mq.name = m.queue
    WHERE m.state NOT IN ('succeeded', 'failed', 'cancelled')
       OR m.completed_at > pgtask.now() - make_interval(
           secs => coalesce(mq.terminal_retention_seconds, {DEFAULT_TERMINAL_RETENTION_SECONDS})))
""")  # noqa: S608 (constants only)
