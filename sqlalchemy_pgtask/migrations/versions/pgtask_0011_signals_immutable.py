"""pgtask 0011: a stored signal never changes, whoever may update the table.

Revision ID: pgtask_0011
Revises: pgtask_0010
Create Date: 2026-12-05

``emit_signal`` writes ``ON CONFLICT DO UPDATE SET value = value`` to lock and return the first
value, which PostgreSQL allows only with ``UPDATE (value)`` on ``pgtask.signals``: the producer
level holds that grant, and with it could rewrite any signal a task has not read yet (an
approval into its opposite), although a signal is immutable.

* ``signals_immutable``: an ``UPDATE`` that would change a stored signal raises SQLSTATE
  ``PT004`` ("pgtask.signals rows are immutable"), for every writer, the owner included. The
  no-op update of a repeated emission changes nothing and passes: the condition sits in the
  trigger's ``WHEN`` clause, so it calls no function.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0011"
down_revision = "pgtask_0010"
branch_labels = None
depends_on = None

_UP = r"""
CREATE FUNCTION pgtask.signal_changed() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'pgtask.signals rows are immutable'
        USING ERRCODE = 'PT004',
              HINT = 'A signal keeps its first value; emit another occurrence instead.';
END
$$;

CREATE TRIGGER signals_immutable
    BEFORE UPDATE ON pgtask.signals
    FOR EACH ROW
    WHEN (OLD.* IS DISTINCT FROM NEW.*)
    EXECUTE FUNCTION pgtask.signal_changed();

-- Only the trigger calls it.
REVOKE EXECUTE ON FUNCTION pgtask.signal_changed() FROM PUBLIC;
"""

_DOWN = r"""
DROP TRIGGER signals_immutable ON pgtask.signals;
DROP FUNCTION pgtask.signal_changed();
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
