"""pgtask 0016: concurrency keys, at most N tasks of one (queue, name, key) hold it at once.

Revision ID: pgtask_0016
Revises: pgtask_0015
Create Date: 2026-12-08

There is no counter to keep right: a task holds its key exactly while ``concurrency_key IS NOT
NULL AND (state = 'running' OR concurrency_held)``. Every way out of running (an outcome, a
retry's backoff, a fenced hand-back, lease expiry, instant rescue, a cancel) therefore
releases the key by changing the state, and a stale attempt's fenced write, which matches no
row, can release nothing.

* ``tasks.concurrency_key`` (text, 1 to 512 bytes), ``concurrency_limit`` (a positive int, only
  with a key: the task's own limit instead of its handler's), ``concurrency_held`` (only with a
  key: set by a durable suspension, sleep or wait, of a handler whose scope is ``workflow``, so
  the key stays held while nothing runs).
* ``handler_policies.concurrency_limit`` and ``concurrency_scope`` (``workflow`` or
  ``running``), frozen with the rest of the policy; ``schedules.concurrency_key`` and
  ``concurrency_limit``, copied into each occurrence.
* ``ix_tasks_concurrency_holders`` (the holders of a key) and ``ix_tasks_concurrency_pending``
  (a key's pending tasks in claim order): both partial, so tasks without a key are in neither.
* ``pgtask.concurrency_admits(id)``: whether a task may take its key now: it holds it already,
  or its key has fewer than its limit holders and it is among the first (limit - holders) due
  pending tasks of that key in claim order. The claim passes over the tasks it refuses, so a
  full key never delays another key's tasks. PUBLIC keeps ``EXECUTE`` on it until the grants
  run again (``grants.grant_roles`` revokes every function from PUBLIC and grants it to the
  worker level): PostgreSQL checks the privilege for every claim, keyed or not, and a worker
  role granted before this revision would otherwise claim nothing. It runs as its caller
  (``SECURITY INVOKER``) and reads only what the claim reads.
* A role that already writes ``tasks.timeout_seconds`` (the producer and worker levels) gets
  ``INSERT`` on the two new task columns, one that writes ``tasks.has_children`` (the worker
  level) ``UPDATE (concurrency_held)``, and one that updates ``schedules.next_run_at``
  ``UPDATE`` on the two new schedule columns: every enqueue of a batch, spawn, suspension and
  materialisation writes them. The downgrade's dropped columns take their grants along.
* ``tasks_concurrency_grant`` (BEFORE UPDATE, a keyed task becoming running): two claims that
  both read a key as free must not both take it, so a grant takes a transaction-level
  advisory lock of the key (``pg_try_advisory_xact_lock``, never waiting) and counts the
  key's holders again with a fresh snapshot; a key another claim is granting, or at its
  limit, skips the row (the claim returns without it; a later claim takes it). Only the
  limit is checked again: the order within a key is the claim's. Running clears
  ``concurrency_held``: the state now holds the key.
* ``tasks_concurrency_release`` (BEFORE UPDATE, a held task finishing) clears
  ``concurrency_held``, so a finished task never holds its key.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0016"
down_revision = "pgtask_0015"
branch_labels = None
depends_on = None

_UP = r"""
ALTER TABLE pgtask.tasks
    ADD COLUMN concurrency_key text,
    ADD COLUMN concurrency_limit integer,
    ADD COLUMN concurrency_held boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT ck_tasks_concurrency_key
        CHECK (concurrency_key IS NULL OR octet_length(concurrency_key) BETWEEN 1 AND 512),
    ADD CONSTRAINT ck_tasks_concurrency_limit
        CHECK (concurrency_limit IS NULL OR (concurrency_limit > 0 AND concurrency_key IS NOT NULL)),
    ADD CONSTRAINT ck_tasks_concurrency_held
        CHECK (NOT concurrency_held OR concurrency_key IS NOT NULL);

CREATE INDEX ix_tasks_concurrency_holders ON pgtask.tasks (queue, name, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND (state = 'running' OR concurrency_held);
CREATE INDEX ix_tasks_concurrency_pending
    ON pgtask.tasks (queue, name, concurrency_key, priority DESC, run_at, id)
    WHERE concurrency_key IS NOT NULL AND state = 'pending';

ALTER TABLE pgtask.handler_policies
    ADD COLUMN concurrency_limit integer,
    ADD COLUMN concurrency_scope text NOT NULL DEFAULT 'workflow',
    ADD CONSTRAINT ck_handler_policies_concurrency_limit
        CHECK (concurrency_limit IS NULL OR concurrency_limit > 0),
    ADD CONSTRAINT ck_handler_policies_concurrency_scope
        CHECK (concurrency_scope IN ('workflow', 'running'));

ALTER TABLE pgtask.schedules
    ADD COLUMN concurrency_key text,
    ADD COLUMN concurrency_limit integer,
    ADD CONSTRAINT ck_schedules_concurrency_key
        CHECK (concurrency_key IS NULL OR octet_length(concurrency_key) BETWEEN 1 AND 512),
    ADD CONSTRAINT ck_schedules_concurrency_limit
        CHECK (concurrency_limit IS NULL OR (concurrency_limit > 0 AND concurrency_key IS NOT NULL));

-- STABLE and SECURITY INVOKER: the claim calls it once per keyed candidate, as the worker, with
-- the claim's snapshot. PL/pgSQL keeps its plans for the session; no SET clause (one would be
-- applied and undone on every call), so every name is qualified.
CREATE FUNCTION pgtask.concurrency_admits(task_id uuid) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t_queue text; t_name text; t_version integer; t_key text; t_limit integer; t_held boolean;
    holders integer;
BEGIN
    SELECT t.queue, t.name, t.version, t.concurrency_key, t.concurrency_limit, t.concurrency_held
    INTO t_queue, t_name, t_version, t_key, t_limit, t_held
    FROM pgtask.tasks AS t WHERE t.id = task_id;
    IF t_key IS NULL OR t_held THEN
        RETURN true;
    END IF;
    IF t_limit IS NULL THEN
        SELECT p.concurrency_limit INTO t_limit FROM pgtask.handler_policies AS p
        WHERE p.queue = t_queue AND p.name = t_name AND p.version = t_version;
        t_limit := coalesce(t_limit, 1);
    END IF;
    SELECT count(*) INTO holders FROM (
        SELECT 1 FROM pgtask.tasks AS h
        WHERE h.queue = t_queue AND h.name = t_name AND h.concurrency_key = t_key
          AND h.concurrency_key IS NOT NULL AND (h.state = 'running' OR h.concurrency_held)
        LIMIT t_limit
    ) AS held;
    IF holders >= t_limit THEN
        RETURN false;
    END IF;
    -- FIFO within the key: only the first free-slots due tasks of the key may take it.
    RETURN task_id IN (
        SELECT w.id FROM pgtask.tasks AS w
        WHERE w.queue = t_queue AND w.name = t_name AND w.concurrency_key = t_key
          AND w.concurrency_key IS NOT NULL AND w.state = 'pending' AND NOT w.concurrency_held
          AND w.run_at <= pgtask.now()
        ORDER BY w.priority DESC, w.run_at, w.id
        LIMIT t_limit - holders
    );
END $$;

CREATE FUNCTION pgtask.concurrency_grant() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
DECLARE
    lim integer := NEW.concurrency_limit;
    holders integer;
BEGIN
    NEW.concurrency_held := false;
    IF OLD.concurrency_held THEN  -- held across a durable suspension: it has the key
        RETURN NEW;
    END IF;
    -- Never waits: two claims granting one key at once would otherwise queue on each other
    -- (and two keys in opposite orders deadlock). The loser skips the row, and takes it, or
    -- the next one, on a later claim.
    -- The first int4 is this lock's class (the key's grants), the second the key's hash.
    IF NOT pg_try_advisory_xact_lock(
        1885828203,  -- "pgtk"; worker locks are "pgta"
        hashtext(NEW.queue || chr(31) || NEW.name || chr(31) || NEW.concurrency_key)
    ) THEN
        RETURN NULL;
    END IF;
    IF lim IS NULL THEN
        SELECT p.concurrency_limit INTO lim FROM pgtask.handler_policies AS p
        WHERE p.queue = NEW.queue AND p.name = NEW.name AND p.version = NEW.version;
        lim := coalesce(lim, 1);
    END IF;
    -- The limit, counted with a fresh snapshot: it sees grants committed since the claim's
    -- own, and the rows this claim granted before this one. Only the limit is checked again
    -- here; the order within the key is the claim's (concurrency_admits), which a grant
    -- racing another claim cannot break beyond the key's limit.
    SELECT count(*) INTO holders FROM (
        SELECT 1 FROM pgtask.tasks AS h
        WHERE h.queue = NEW.queue AND h.name = NEW.name AND h.concurrency_key = NEW.concurrency_key
          AND h.concurrency_key IS NOT NULL AND (h.state = 'running' OR h.concurrency_held)
        LIMIT lim
    ) AS held;
    IF holders >= lim THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER tasks_concurrency_grant BEFORE UPDATE ON pgtask.tasks
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.state = 'running' AND OLD.state <> 'running')
    EXECUTE FUNCTION pgtask.concurrency_grant();

CREATE FUNCTION pgtask.concurrency_release() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    NEW.concurrency_held := false;
    RETURN NEW;
END $$;

CREATE TRIGGER tasks_concurrency_release BEFORE UPDATE ON pgtask.tasks
    FOR EACH ROW
    WHEN (NEW.concurrency_held AND NEW.state IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION pgtask.concurrency_release();

-- Roles granted a level before this revision: the new columns are written by statements every
-- producer and worker sends (a batch enqueue, a spawn, a suspension, a materialisation), so
-- each role gets them with the columns it already writes, as grants.grant_roles would.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT p.grantee, p.table_name, p.privilege_type, p.column_name
        FROM information_schema.column_privileges AS p
        JOIN pg_catalog.pg_class AS c ON c.relname = p.table_name
        JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace AND n.nspname = p.table_schema
        WHERE p.table_schema = 'pgtask'
          AND p.grantee NOT IN ('PUBLIC', pg_catalog.pg_get_userbyid(c.relowner))
          AND NOT EXISTS (  -- a privilege on the whole table covers the new columns already
              SELECT FROM information_schema.table_privileges AS t
              WHERE t.grantee = p.grantee AND t.table_schema = 'pgtask'
                AND t.table_name = p.table_name AND t.privilege_type = p.privilege_type
          )
          AND (p.table_name, p.privilege_type, p.column_name) IN (
              ('tasks', 'INSERT', 'timeout_seconds'),
              ('tasks', 'UPDATE', 'has_children'),
              ('schedules', 'UPDATE', 'next_run_at')
          )
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT %s (%s) ON pgtask.%I TO %I', g.privilege_type,
            CASE WHEN g.privilege_type = 'UPDATE' AND g.table_name = 'tasks'
                 THEN 'concurrency_held' ELSE 'concurrency_key, concurrency_limit' END,
            g.table_name, g.grantee
        );
    END LOOP;
END $$;

REVOKE ALL ON FUNCTION pgtask.concurrency_grant() FROM PUBLIC;
REVOKE ALL ON FUNCTION pgtask.concurrency_release() FROM PUBLIC;
"""

_DOWN = r"""
DROP TRIGGER tasks_concurrency_release ON pgtask.tasks;
DROP TRIGGER tasks_concurrency_grant ON pgtask.tasks;
DROP FUNCTION pgtask.concurrency_release();
DROP FUNCTION pgtask.concurrency_grant();
DROP FUNCTION pgtask.concurrency_admits(uuid);
ALTER TABLE pgtask.schedules DROP COLUMN concurrency_limit, DROP COLUMN concurrency_key;
ALTER TABLE pgtask.handler_policies
    DROP COLUMN concurrency_scope, DROP COLUMN concurrency_limit;
DROP INDEX pgtask.ix_tasks_concurrency_pending;
DROP INDEX pgtask.ix_tasks_concurrency_holders;
ALTER TABLE pgtask.tasks
    DROP COLUMN concurrency_held, DROP COLUMN concurrency_limit, DROP COLUMN concurrency_key;
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
