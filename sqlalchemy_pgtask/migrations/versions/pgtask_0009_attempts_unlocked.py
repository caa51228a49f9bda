"""pgtask 0009: a claim's attempt rows no longer lock the task they record.

Revision ID: pgtask_0009
Revises: pgtask_0008
Create Date: 2026-12-02

``pgtask.attempts.task_id`` was a foreign key to ``pgtask.tasks``. PostgreSQL checks a foreign
key row by row, with a query that takes a ``KEY SHARE`` lock on the referenced row: a claim,
which inserts one attempt row for each task it updates, locked every task it had just updated
once more, and wrote that lock to the heap and the WAL: 7-11 us per claimed task and 0.12-0.27
ms of a one-task claim in ``EXPLAIN ANALYZE``; without it a worker's drain at concurrency 100
cost PostgreSQL 86-100 us per task instead of 110-115.

Nothing needs the check: attempt rows are inserted only by the claim, in the statement that
updates the very tasks they name, so each names a task that exists. The revision drops the
constraint and keeps what its ``ON DELETE CASCADE`` did with two statement-level triggers that
run as their owner (``SECURITY DEFINER``, like the other trigger helpers):

* ``tasks_delete_attempts``: deleting tasks deletes their attempts, in one statement for the
  whole ``DELETE`` (retention's batches included);
* ``tasks_truncate_attempts``: ``TRUNCATE pgtask.tasks`` empties ``pgtask.attempts`` too (with
  ``DELETE`` when the statement truncates both tables or a cursor reads attempts).

The downgrade deletes attempt rows whose task is gone (there are none unless the triggers were
disabled) and restores the foreign key.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0009"
down_revision = "pgtask_0008"
branch_labels = None
depends_on = None

_UP = r"""
CREATE FUNCTION pgtask.attempts_of_deleted() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    DELETE FROM pgtask.attempts AS a USING deleted AS d WHERE a.task_id = d.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_delete_attempts
    AFTER DELETE ON pgtask.tasks
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT
    EXECUTE FUNCTION pgtask.attempts_of_deleted();

CREATE FUNCTION pgtask.attempts_of_truncated() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    BEGIN
        TRUNCATE pgtask.attempts;
    EXCEPTION WHEN object_in_use THEN
        -- The same statement truncates attempts too (or this session has a cursor on it).
        DELETE FROM pgtask.attempts;
    END;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_truncate_attempts
    AFTER TRUNCATE ON pgtask.tasks
    FOR EACH STATEMENT
    EXECUTE FUNCTION pgtask.attempts_of_truncated();

-- Only the triggers call these; run by hand as their owner they would delete history.
REVOKE EXECUTE ON FUNCTION pgtask.attempts_of_deleted() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION pgtask.attempts_of_truncated() FROM PUBLIC;
"""

_DOWN = r"""
DROP TRIGGER tasks_truncate_attempts ON pgtask.tasks;
DROP TRIGGER tasks_delete_attempts ON pgtask.tasks;
DROP FUNCTION pgtask.attempts_of_truncated();
DROP FUNCTION pgtask.attempts_of_deleted();
DELETE FROM pgtask.attempts AS a WHERE NOT EXISTS (SELECT FROM pgtask.tasks AS t WHERE t.id = a.task_id);
"""


def upgrade() -> None:
    op.drop_constraint("fk_attempts_task_id_tasks", "attempts", schema="pgtask", type_="foreignkey")
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
    op.create_foreign_key(
        "fk_attempts_task_id_tasks", "attempts", "tasks", ["task_id"], ["id"],
        source_schema="pgtask", referent_schema="pgtask", ondelete="CASCADE",
    )
