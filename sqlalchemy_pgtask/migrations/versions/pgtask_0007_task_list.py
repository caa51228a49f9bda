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
id)``: the revision then finds it and builds nothing (``IF NOT EXISTS``).
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0007"
down_revision = "pgtask_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_tasks_created", "tasks", ["created_at", "id"], schema="pgtask", if_not_exists=True
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_created", table_name="tasks", schema="pgtask")
