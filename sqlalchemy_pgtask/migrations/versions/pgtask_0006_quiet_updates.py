"""pgtask 0006: updates that finish nothing leave ``tasks_terminal_changed`` at once.

Revision ID: pgtask_0006
Revises: pgtask_0005
Create Date: 2026-12-01

The statement-level ``tasks_terminal_changed`` (0005) runs for every ``UPDATE`` of
``pgtask.tasks``, and most of those (claims, lease renewals, releases, sleeps) move no row
into or out of a terminal state. Its function now returns as soon as neither transition table
holds a terminal row, instead of joining them, aggregating and inserting nothing: about a
fifth of a one-task claim's execution time. Same trigger, same behaviour.
"""

from __future__ import annotations

from alembic import op

from sqlalchemy_pgtask.migrations.versions import pgtask_0005_fast_paths as previous

revision = "pgtask_0006"
down_revision = "pgtask_0005"
branch_labels = None
depends_on = None

#: 0005's function, replaced in place (the trigger stays).
_FUNCTION_0005 = previous._UP[
    previous._UP.index("CREATE FUNCTION") : previous._UP.index("CREATE TRIGGER")
].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)

_QUIET_EXIT = """BEGIN
    IF NOT EXISTS (SELECT FROM new_rows WHERE state IN ('succeeded', 'failed', 'cancelled'))
       AND NOT EXISTS (SELECT FROM old_rows WHERE state IN ('succeeded', 'failed', 'cancelled'))
    THEN
        RETURN NULL;  -- a claim, a renewal, a release: nothing finished or came back
    END IF;
"""

_FUNCTION_0006 = _FUNCTION_0005.replace("BEGIN\n", _QUIET_EXIT, 1)


def upgrade() -> None:
    op.execute(_FUNCTION_0006)


def downgrade() -> None:
    op.execute(_FUNCTION_0005)
