"""pgtask 0010: capacity stays exact for transactions that keep one snapshot.

Revision ID: pgtask_0010
Revises: pgtask_0009
Create Date: 2026-12-04

The capacity triggers read a queue's row to learn whether it has a limit. A REPEATABLE READ or
SERIALIZABLE transaction reads it from its first snapshot: one that began before another
transaction set the limit (or created the queue with one) saw no limit, so its enqueue was
neither counted nor refused (past ``max_outstanding_tasks``) and its finished tasks released
nothing (the counter stayed high for good). Under such a snapshot now:

* an enqueue, a retry, a task that finishes and an outstanding task deleted call
  ``pgtask.queues_current`` first, which raises a serialization failure (SQLSTATE ``40001``;
  retry the transaction) when a queue row it involves changed or appeared since the
  snapshot: it locks the unlimited rows ``FOR SHARE`` and probes for a row it cannot see with
  an insert it undoes at once (a subtransaction). Each queue is checked once per transaction:
  once the transaction has written to ``pgtask.tasks``, no limit can be turned on before it
  ends (the recount waits for it).

READ COMMITTED transactions (the default, and every worker statement) run as before. Also:

* ``tasks_truncate_capacity``: ``TRUNCATE pgtask.tasks`` sets every limited queue's counter
  to 0 and empties ``pgtask.capacity_releases`` (function ``pgtask.capacity_truncated()``).

Downgrade restores the previous function bodies and drops the trigger.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0010"
down_revision = "pgtask_0009"
branch_labels = None
depends_on = None

_STALE = "current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted')"

# The bodies this revision replaces, as pgtask_0009 left them (pg_get_functiondef's form).
_ADMIT = r"""
CREATE OR REPLACE FUNCTION pgtask.admit(p_queues text[], p_counts bigint[])
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgtask', 'pg_temp'
AS $function$
DECLARE
    v_limited text[];
    v_over record;
BEGIN
    SELECT array_agg(locked.name) INTO v_limited FROM (
        SELECT q.name FROM pgtask.queues AS q
        WHERE q.name = ANY (p_queues) AND q.max_outstanding_tasks IS NOT NULL
        ORDER BY q.name
        FOR NO KEY UPDATE
    ) AS locked;
    IF v_limited IS NULL THEN
        RETURN;
    END IF;

    WITH demand AS (
        SELECT d.queue, d.n FROM unnest(p_queues, p_counts) AS d(queue, n)
        WHERE d.queue = ANY (v_limited)
    ), released AS (
        DELETE FROM pgtask.capacity_releases AS r
        WHERE r.queue = ANY (v_limited)
        RETURNING r.queue, r.released
    ), freed AS (
        SELECT r.queue, sum(r.released) AS n FROM released AS r GROUP BY r.queue
    ), admitted AS (
        UPDATE pgtask.queues AS q
        SET outstanding_tasks = greatest(q.outstanding_tasks - coalesce(f.n, 0), 0) + d.n
        FROM demand AS d LEFT JOIN freed AS f ON f.queue = d.queue
        WHERE q.name = d.queue
        RETURNING q.name, q.outstanding_tasks, q.max_outstanding_tasks
    )
    SELECT * INTO v_over FROM admitted
    WHERE outstanding_tasks > max_outstanding_tasks
    ORDER BY name
    LIMIT 1;

    IF FOUND THEN
        RAISE EXCEPTION 'queue % has reached its capacity of % outstanding tasks',
            v_over.name, v_over.max_outstanding_tasks
            USING ERRCODE = 'PT001', HINT = 'Capacity is back-pressure: retry the enqueue later.';
    END IF;
END
$function$
"""

_TERMINAL_CHANGED = r"""
CREATE OR REPLACE FUNCTION pgtask.terminal_changed()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgtask', 'pg_temp'
AS $function$
DECLARE
    v_queues text[];
    v_counts bigint[];
    v_notified bigint;
BEGIN
    IF NOT EXISTS (SELECT FROM new_rows WHERE state IN ('succeeded', 'failed', 'cancelled'))
       AND NOT EXISTS (SELECT FROM old_rows WHERE state IN ('succeeded', 'failed', 'cancelled'))
    THEN
        RETURN NULL;  -- a claim, a renewal, a release: nothing finished or came back
    END IF;
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
$function$
"""

_CAPACITY_DELETED = r"""
CREATE OR REPLACE FUNCTION pgtask.capacity_deleted()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgtask', 'pg_temp'
AS $function$
BEGIN
    INSERT INTO pgtask.capacity_releases (queue, released)
    SELECT q.name, 1 FROM pgtask.queues AS q
    WHERE q.name = OLD.queue AND q.max_outstanding_tasks IS NOT NULL;
    RETURN NULL;
END
$function$
"""


def _edited(body: str, *edits: tuple[str, str]) -> str:
    """``body`` with each ``(old, new)`` replaced; each ``old`` is there exactly once."""
    for old, new in edits:
        if body.count(old) != 1:
            raise ValueError(f"not exactly once in the frozen body: {old!r}")
        body = body.replace(old, new)
    return body


_NEW_ADMIT = _edited(_ADMIT, (
    "BEGIN\n    SELECT array_agg(locked.name)",
    f"BEGIN\n    IF {_STALE} THEN\n        PERFORM pgtask.queues_current(p_queues);\n"
    "    END IF;\n    SELECT array_agg(locked.name)",
))

_NEW_TERMINAL_CHANGED = _edited(_TERMINAL_CHANGED, (
    "    WITH moved AS MATERIALIZED (",
    f"    IF {_STALE} THEN\n"  # noqa: S608 (constants only, as everywhere below)
    "        -- Its snapshot may show a queue row older than a limit: check before releasing.\n"
    "        PERFORM pgtask.queues_current(ARRAY(SELECT DISTINCT queue FROM new_rows));\n"
    "    END IF;\n"
    "    WITH moved AS MATERIALIZED (",
))

_NEW_CAPACITY_DELETED = _edited(_CAPACITY_DELETED, (
    "BEGIN\n    INSERT INTO pgtask.capacity_releases",
    f"BEGIN\n    IF {_STALE} THEN\n"
    "        PERFORM pgtask.queues_current(ARRAY[OLD.queue]);\n"
    "    END IF;\n"
    "    INSERT INTO pgtask.capacity_releases",
))

_UP = r"""
-- Whether the queue rows this transaction's snapshot shows for p_queues are the latest:
-- raises a serialization failure (40001) when one changed or appeared since the snapshot.
-- Only for REPEATABLE READ and SERIALIZABLE, whose statements all read the first snapshot.
CREATE FUNCTION pgtask.queues_current(p_queues text[]) RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
DECLARE
    v_checked text[] := string_to_array(nullif(current_setting('pgtask.checked_queues', true), ''), ',');
    v_new text[];
    v_missing text;
BEGIN
    -- Once per queue and transaction: after its first write to pgtask.tasks, a limit cannot
    -- be turned on (the recount waits for it to end), and the rows it locked stay locked.
    SELECT array_agg(DISTINCT d.name ORDER BY d.name) INTO v_new
    FROM unnest(p_queues) AS d(name)
    WHERE v_checked IS NULL OR NOT d.name = ANY (v_checked);
    IF v_new IS NULL THEN
        RETURN;
    END IF;
    -- A row changed since the snapshot cannot be locked (40001). Limited rows are left to
    -- admit's own lock: a FOR SHARE first would deadlock two producers upgrading it, and a
    -- finisher never waits for a limited queue's row.
    PERFORM 1 FROM pgtask.queues AS q
    WHERE q.name = ANY (v_new) AND q.max_outstanding_tasks IS NULL
    ORDER BY q.name
    FOR SHARE;
    -- A row created since the snapshot is invisible, but inserting its name meets it (40001);
    -- the probe's own row is undone at once, so producers never collide on it.
    FOR v_missing IN
        SELECT d.name FROM unnest(v_new) AS d(name)
        WHERE NOT EXISTS (SELECT FROM pgtask.queues AS q WHERE q.name = d.name)
    LOOP
        BEGIN
            INSERT INTO pgtask.queues (name) VALUES (v_missing) ON CONFLICT (name) DO NOTHING;
            RAISE EXCEPTION USING ERRCODE = 'PTX01';
        EXCEPTION WHEN SQLSTATE 'PTX01' THEN
            NULL;
        END;
    END LOOP;
    PERFORM set_config('pgtask.checked_queues', array_to_string(coalesce(v_checked, '{}') || v_new, ','), true);
END
$$;

REVOKE EXECUTE ON FUNCTION pgtask.queues_current(text[]) FROM PUBLIC;

""" + ";\n\n".join(b.strip() for b in (_NEW_ADMIT, _NEW_TERMINAL_CHANGED, _NEW_CAPACITY_DELETED)) + r""";

-- TRUNCATE pgtask.tasks leaves no outstanding task behind.
CREATE FUNCTION pgtask.capacity_truncated() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    UPDATE pgtask.queues SET outstanding_tasks = 0
    WHERE max_outstanding_tasks IS NOT NULL AND outstanding_tasks <> 0;
    DELETE FROM pgtask.capacity_releases;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_truncate_capacity
    AFTER TRUNCATE ON pgtask.tasks
    FOR EACH STATEMENT
    EXECUTE FUNCTION pgtask.capacity_truncated();

REVOKE EXECUTE ON FUNCTION pgtask.capacity_truncated() FROM PUBLIC;
"""  # noqa: S608 (constants only)

_DOWN = r"""
DROP TRIGGER tasks_truncate_capacity ON pgtask.tasks;
DROP FUNCTION pgtask.capacity_truncated();
""" + ";\n\n".join(b.strip() for b in (_ADMIT, _TERMINAL_CHANGED, _CAPACITY_DELETED)) + r""";
DROP FUNCTION pgtask.queues_current(text[]);
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
