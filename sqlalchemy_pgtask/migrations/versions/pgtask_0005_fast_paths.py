"""pgtask 0005: one trigger run per statement for tasks entering or leaving a terminal state.

Revision ID: pgtask_0005
Revises: pgtask_0004
Create Date: 2026-12-01

``tasks_terminal_changed`` ran once per row (a PL/pgSQL call, one ``pg_notify`` and one
capacity-release insert for every task a batch finished: about a third of what completing a
batch cost PostgreSQL). It now runs once per ``UPDATE`` statement on the rows that statement
moved into or out of a terminal state, read from its transition tables:

* result waiters get one ``pgtask_result`` notification per 200 finished tasks, their ids
  separated by commas (a payload holds at most 8,000 bytes);
* capacity releases are inserted one row per capacity-limited queue, not one per task;
* rows back from a terminal state (an administrative retry) are admitted per queue in one
  ``admit`` call, which raises ``PT001`` for a queue at capacity as before.

PostgreSQL allows transition tables only on a trigger without a column list, so the trigger
runs for every ``UPDATE`` of ``pgtask.tasks`` and finds nothing to do in most (claims, lease
renewals): one join of two small tuplestores.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0005"
down_revision = "pgtask_0004"
branch_labels = None
depends_on = None

_UP = r"""
DROP TRIGGER tasks_terminal_changed ON pgtask.tasks;
DROP FUNCTION pgtask.terminal_changed();

CREATE FUNCTION pgtask.terminal_changed() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
DECLARE
    v_queues text[];
    v_counts bigint[];
    v_notified bigint;
BEGIN
    WITH moved AS MATERIALIZED (
        SELECT n.id, n.queue, n.state IN ('succeeded', 'failed', 'cancelled') AS finished
        FROM new_rows AS n JOIN old_rows AS o ON o.id = n.id
        WHERE (n.state IN ('succeeded', 'failed', 'cancelled')) <> (o.state IN ('succeeded', 'failed', 'cancelled'))
    ), chunks AS (
        SELECT id, (row_number() OVER () - 1) / 200 AS chunk FROM moved WHERE finished
    ), notified AS (
        -- Result waiters LISTEN on this channel; the payload is finished tasks' ids.
        SELECT pg_notify('pgtask_result', string_agg(id::text, ',')) FROM chunks GROUP BY chunk
    ), released AS (
        -- A plain read of the queue row: it never waits for a producer holding it.
        INSERT INTO pgtask.capacity_releases (queue, released)
        SELECT q.name, count(*) FROM moved AS m JOIN pgtask.queues AS q ON q.name = m.queue
        WHERE m.finished AND q.max_outstanding_tasks IS NOT NULL
        GROUP BY q.name
    ), returned AS (
        -- Back from terminal (an administrative retry) needs room like a new task.
        SELECT queue, count(*) AS n FROM moved WHERE NOT finished GROUP BY queue
    )
    SELECT array_agg(queue ORDER BY queue), array_agg(n ORDER BY queue),
           (SELECT count(*) FROM notified)
    INTO v_queues, v_counts, v_notified
    FROM returned;
    IF v_queues IS NOT NULL THEN
        PERFORM pgtask.admit(v_queues, v_counts);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_terminal_changed
    AFTER UPDATE ON pgtask.tasks
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION pgtask.terminal_changed();
"""

_DOWN = r"""
DROP TRIGGER tasks_terminal_changed ON pgtask.tasks;
DROP FUNCTION pgtask.terminal_changed();

CREATE FUNCTION pgtask.terminal_changed() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    IF NEW.state IN ('succeeded', 'failed', 'cancelled') THEN
        PERFORM pg_notify('pgtask_result', NEW.id::text);
        INSERT INTO pgtask.capacity_releases (queue, released)
        SELECT q.name, 1 FROM pgtask.queues AS q
        WHERE q.name = NEW.queue AND q.max_outstanding_tasks IS NOT NULL;
    ELSE
        PERFORM pgtask.admit(ARRAY[NEW.queue], ARRAY[1::bigint]);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_terminal_changed
    AFTER UPDATE OF state ON pgtask.tasks
    FOR EACH ROW
    WHEN ((OLD.state IN ('succeeded', 'failed', 'cancelled')) <> (NEW.state IN ('succeeded', 'failed', 'cancelled')))
    EXECUTE FUNCTION pgtask.terminal_changed();
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
