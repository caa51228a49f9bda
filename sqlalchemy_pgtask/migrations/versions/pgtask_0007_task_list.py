"""pgtask 0007: an index on ``(created_at, id)`` for the task list.

Revision ID: pgtask_0007
Revises: pgtask_0006
Create Date: 2026-12-01

The dashboard lists tasks newest first by ``created_at`` and pages on ``(created_at, id)``.
Without this index a created range far back walked the primary key from today to the range
(a third of a million-row table for a day ten days back), because the planner assumes the
matching rows are spread evenly over the ids.

``CREATE INDEX`` holds a ``SHARE`` lock on ``pgtask.tasks`` while it builds: enqueues and
claims wait, for seconds on a table of millions of rows. On such a table, build the index
beforehand with ``CREATE INDEX CONCURRENTLY ix_tasks_created ON pgtask.tasks (created_at,
id)``: the revision then keeps it. It keeps only a valid index of exactly that definition: a
concurrent build that failed or was cancelled leaves an invalid index behind, which the
planner never uses, so the revision drops it (or any other index of that name) and builds
the index itself.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0007"
down_revision = "pgtask_0006"
branch_labels = None
depends_on = None

# One DO block rather than a catalog read in Python, so offline mode (``--sql``) emits it too.
_UP = """
DO $$
BEGIN
    IF NOT EXISTS (
        -- Compared by structure: pg_get_indexdef's text depends on the search_path.
        SELECT FROM pg_index AS i
        JOIN pg_class AS c ON c.oid = i.indexrelid
        JOIN pg_am AS am ON am.oid = c.relam
        WHERE i.indexrelid = to_regclass('pgtask.ix_tasks_created')
          AND i.indrelid = 'pgtask.tasks'::regclass
          AND i.indisvalid AND NOT i.indisunique AND am.amname = 'btree'
          AND i.indpred IS NULL AND i.indexprs IS NULL
          AND i.indkey::text = array_to_string(ARRAY(
              SELECT a.attnum FROM unnest(ARRAY['created_at', 'id']) WITH ORDINALITY AS k(name, n)
              JOIN pg_attribute AS a ON a.attrelid = 'pgtask.tasks'::regclass AND a.attname = k.name
              ORDER BY k.n
          ), ' ')
    ) THEN
        DROP INDEX IF EXISTS pgtask.ix_tasks_created;
        CREATE INDEX ix_tasks_created ON pgtask.tasks (created_at, id);
    END IF;
END
$$;
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.drop_index("ix_tasks_created", table_name="tasks", schema="pgtask")
