"""pgtask 0013: a cascading cancellation walks the subtree once.

Revision ID: pgtask_0013
Revises: pgtask_0012
Create Date: 2026-12-07

``pgtask.cancel_descendants()`` (trigger ``tasks_cancel_descendants``, ``pgtask_0003``) is a row
trigger: a task that ends cancels its whole subtree, and every descendant it cancels fires it
again, which walked that descendant's whole subtree once more. A chain of n tasks cost about
n^2/2 row visits: 5.7 s to cancel the root of a chain of 4,000, and the parent above a chain
of 2,000 could not record its outcome under ``statement_timeout = 3s``.

* The function is replaced, with the same trigger, locks and results. It walks the subtree
  level by level, one probe of ``ix_tasks_parent`` per task (a join or a state condition in
  the walk could be planned, and the plan cached for the session, as a scan of every task or
  every outstanding one per level), through finished tasks too (``retry()`` makes a task
  below a finished one outstanding again), then cancels what it found with one update. The
  firings that update causes (each descendant it cancels, marked ``ancestor_finished``) end
  at once, since the walk that cancelled them took their subtrees: the cascade is one walk
  of the subtree, plus a constant per cancelled descendant.
* A cancelled descendant's times are ``greatest(now, updated_at)``, as ``cancel()``'s: they
  never go back before the task's last change.

Lock order is unchanged: the task that ends is locked by its own statement, its descendants
after it, by the update.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0013"
down_revision = "pgtask_0012"
branch_labels = None
depends_on = None

_UP = r"""
CREATE OR REPLACE FUNCTION pgtask.cancel_descendants() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
DECLARE
    level uuid[] := ARRAY[NEW.id];
    doomed uuid[] := '{}';
    stamp timestamptz;
BEGIN
    -- Fired again by each descendant the update below cancels, or by each task of a subtree
    -- a wait timeout cancels (statements.waits): the walk that cancelled it already took
    -- everything below it, so it ends here without a probe.
    IF NEW.error ->> 'reason' = 'result_wait_timeout'
       OR (pg_trigger_depth() > 1 AND NEW.error ->> 'reason' = 'ancestor_finished') THEN
        RETURN NULL;
    END IF;
    -- Level by level, one probe of ix_tasks_parent per task: a lateral subquery the planner
    -- cannot flatten (OFFSET 0), by parent_id alone. A join, or a state condition, could be
    -- planned (and the plan cached for the session) as a scan of every task or every
    -- outstanding one per level: n^2 on a chain. Through finished tasks too: retry() makes
    -- a task below a finished one outstanding again, and it must still be reached.
    LOOP
        SELECT coalesce(array_agg(c.id), '{}')
        INTO level
        FROM unnest(level) AS p(id)
        CROSS JOIN LATERAL (
            SELECT t.id, t.state FROM pgtask.tasks AS t WHERE t.parent_id = p.id OFFSET 0
        ) AS c;
        EXIT WHEN cardinality(level) = 0;
        IF cardinality(level) = 1 THEN
            doomed := array_append(doomed, level[1]);  -- in place: a chain stays linear
        ELSE
            doomed := doomed || level;
        END IF;
    END LOOP;
    IF cardinality(doomed) = 0 THEN
        RETURN NULL;
    END IF;
    stamp := pgtask.now();
    UPDATE pgtask.tasks AS t
    SET state = CASE WHEN t.state = 'running' THEN t.state ELSE 'cancelled' END,
        cancel_requested_at = coalesce(t.cancel_requested_at, greatest(stamp, t.updated_at)),
        completed_at = CASE WHEN t.state = 'running' THEN t.completed_at
                            ELSE greatest(stamp, t.updated_at) END,
        error = CASE WHEN t.state = 'running' THEN t.error
                     ELSE jsonb_build_object('type', 'cancelled', 'reason', 'ancestor_finished',
                                             'ancestor_id', NEW.id) END,
        updated_at = greatest(stamp, t.updated_at)
    WHERE t.id = ANY (doomed)
      AND t.state IN ('pending', 'running', 'waiting')
      AND NOT (t.state = 'running' AND t.cancel_requested_at IS NOT NULL);
    RETURN NULL;
END
$$;
"""

#: ``pgtask_0003``'s function, as ``pgtask_0004`` left it (definer, fixed search path).
_DOWN = r"""
CREATE OR REPLACE FUNCTION pgtask.cancel_descendants() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    WITH RECURSIVE tree AS (
        SELECT id FROM pgtask.tasks WHERE parent_id = NEW.id
        UNION
        SELECT t.id FROM pgtask.tasks AS t JOIN tree ON t.parent_id = tree.id
    )
    UPDATE pgtask.tasks AS t
    SET state = CASE WHEN t.state = 'running' THEN t.state ELSE 'cancelled' END,
        cancel_requested_at = coalesce(t.cancel_requested_at, pgtask.now()),
        completed_at = CASE WHEN t.state = 'running' THEN t.completed_at ELSE pgtask.now() END,
        error = CASE WHEN t.state = 'running' THEN t.error
                     ELSE jsonb_build_object('type', 'cancelled', 'reason', 'ancestor_finished',
                                             'ancestor_id', NEW.id) END,
        updated_at = pgtask.now()
    WHERE t.id IN (SELECT id FROM tree)
      AND t.state IN ('pending', 'running', 'waiting')
      AND NOT (t.state = 'running' AND t.cancel_requested_at IS NOT NULL);
    RETURN NULL;
END
$$;
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
