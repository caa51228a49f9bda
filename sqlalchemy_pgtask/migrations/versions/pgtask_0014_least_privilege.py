"""pgtask 0014: what the levels' grants allowed beyond the library's own calls is refused.

Revision ID: pgtask_0014
Revises: pgtask_0013
Create Date: 2026-12-07

Column grants cannot say which rows, or which new values, a statement may write. Three
triggers say it, for every role but the schema's owner (and its members: foreign key
cascades and the ``SECURITY DEFINER`` trigger helpers run as the owner):

* ``checkpoints_immutable``: an ``UPDATE`` that would change a stored checkpoint raises
  SQLSTATE ``PT005``, for every writer, the owner included (as ``signals_immutable``). The
  worker keeps ``UPDATE (value)``: a durable sleep and a signal wait lock and return the first
  value with ``ON CONFLICT DO UPDATE SET value = value``, a no-op the trigger's ``WHEN``
  clause lets through.
* ``tasks_delete_terminal``: a ``DELETE`` of a task that has not finished raises ``PT006``.
  Retention (worker and admin levels) deletes only finished tasks; a worker could delete any.
* ``idempotency_keys_take_over``: the producer's ``UPDATE`` of a key (taking over an expired
  reservation, ``statements.TAKE_OVER_KEYS``) raises ``PT007`` unless the reservation has
  expired by ``pgtask.now()``, keeps its queue and key, points at a task id no task has yet,
  with ``created_at`` now and no ``expires_at``; and ``idempotency_keys_taken_task``, a
  constraint trigger checked at commit, raises ``PT007`` unless that task then exists with
  the key's queue and key. A producer can no longer extend, release or re-point a live key.
* ``pgtask.queues_current()`` (``pgtask_0010``) no longer trusts the setting
  ``pgtask.checked_queues`` for the queues a transaction checked already: any role may
  ``SET LOCAL`` it, so a producer in a REPEATABLE READ transaction could name a queue and be
  admitted by a limit its snapshot did not show. They are kept in a temporary table of the
  function's owner instead (``pg_temp.pgtask_checked_queues``, ``ON COMMIT DELETE ROWS``,
  created once per session), which the caller cannot write; one of that name the caller
  made itself is ignored, and without ``TEMP`` on the database every call checks. A
  transaction that wrote it cannot ``PREPARE TRANSACTION``.
* A role holding ``INSERT`` on all of ``pgtask.audit_log`` (the admin level) gets it on every
  column but ``id`` and ``occurred_at`` instead: the database numbers and dates each entry.
  The downgrade leaves these grants as they are.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0014"
down_revision = "pgtask_0013"
branch_labels = None
depends_on = None

#: Whether the role running the statement is the table's owner (or a member of it): such a
#: role could drop the trigger anyway, and the cascades and trigger helpers run as it.
_OWNER = (
    "pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class AS c"
    " WHERE c.oid = TG_RELID), 'MEMBER')"
)

_UP = r"""
CREATE FUNCTION pgtask.checkpoint_changed() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'pgtask.checkpoints rows are immutable'
        USING ERRCODE = 'PT005',
              HINT = 'A durable step keeps the first value it stored.';
END
$$;

CREATE TRIGGER checkpoints_immutable
    BEFORE UPDATE ON pgtask.checkpoints
    FOR EACH ROW
    WHEN (OLD.* IS DISTINCT FROM NEW.*)
    EXECUTE FUNCTION pgtask.checkpoint_changed();

REVOKE EXECUTE ON FUNCTION pgtask.checkpoint_changed() FROM PUBLIC;

-- Invoker's rights on purpose: current_user is the role that runs the DELETE.
CREATE FUNCTION pgtask.task_delete_refused() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    IF """ + _OWNER + r""" THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'task % is %: only a finished task may be deleted', OLD.id, OLD.state
        USING ERRCODE = 'PT006',
              HINT = 'Cancel it first; retention deletes finished tasks.';
END
$$;

CREATE TRIGGER tasks_delete_terminal
    BEFORE DELETE ON pgtask.tasks
    FOR EACH ROW
    WHEN (OLD.state NOT IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION pgtask.task_delete_refused();

REVOKE EXECUTE ON FUNCTION pgtask.task_delete_refused() FROM PUBLIC;

CREATE FUNCTION pgtask.key_take_over() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
DECLARE
    v_now timestamptz := pgtask.now();
BEGIN
    IF """ + _OWNER + r""" THEN
        RETURN NEW;
    END IF;
    IF NEW.queue = OLD.queue AND NEW.key = OLD.key
        AND NEW.task_id IS DISTINCT FROM OLD.task_id
        AND NEW.expires_at IS NULL AND NEW.created_at = v_now
        AND (
            (OLD.expires_at IS NOT NULL AND OLD.expires_at <= v_now)
            OR (OLD.expires_at IS NULL AND EXISTS (
                SELECT FROM pgtask.tasks AS t
                WHERE t.id = OLD.task_id
                  AND t.state IN ('succeeded', 'failed', 'cancelled')
                  AND t.completed_at + make_interval(secs => coalesce(
                      (SELECT q.idempotency_retention_seconds FROM pgtask.queues AS q
                       WHERE q.name = OLD.queue), 2592000)) <= v_now
            ))
        )
        AND NOT EXISTS (SELECT FROM pgtask.tasks AS t WHERE t.id = NEW.task_id)
    THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'idempotency key % of queue % may only be taken over once expired, for a new task', OLD.key, OLD.queue
        USING ERRCODE = 'PT007';
END
$$;

CREATE TRIGGER idempotency_keys_take_over
    BEFORE UPDATE ON pgtask.idempotency_keys
    FOR EACH ROW
    EXECUTE FUNCTION pgtask.key_take_over();

CREATE FUNCTION pgtask.key_taken_task() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    IF """ + _OWNER + r""" OR EXISTS (
        SELECT FROM pgtask.tasks AS t
        WHERE t.id = NEW.task_id AND t.queue = NEW.queue AND t.idempotency_key = NEW.key
    ) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'idempotency key % of queue % was taken over for no task of that key', NEW.key, NEW.queue
        USING ERRCODE = 'PT007';
END
$$;

CREATE CONSTRAINT TRIGGER idempotency_keys_taken_task
    AFTER UPDATE ON pgtask.idempotency_keys
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.task_id IS DISTINCT FROM OLD.task_id)
    EXECUTE FUNCTION pgtask.key_taken_task();

REVOKE EXECUTE ON FUNCTION pgtask.key_take_over() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION pgtask.key_taken_task() FROM PUBLIC;

-- A role granted INSERT on the whole audit log (the admin level before this revision) keeps
-- it until revoked, grants being additive: it becomes the column grant pgtask grants gives.
DO $$
DECLARE
    v_grantee oid;
BEGIN
    FOR v_grantee IN
        SELECT a.grantee FROM pg_catalog.pg_class AS c, aclexplode(c.relacl) AS a
        WHERE c.oid = 'pgtask.audit_log'::regclass AND a.privilege_type = 'INSERT'
          AND a.grantee <> c.relowner AND a.grantee <> 0
    LOOP
        EXECUTE format('REVOKE INSERT ON pgtask.audit_log FROM %I', v_grantee::regrole);
        EXECUTE format(
            'GRANT INSERT (actor, action, task_id, queue, schedule, reason, details)'
            ' ON pgtask.audit_log TO %I', v_grantee::regrole);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION pgtask.queues_current(p_queues text[]) RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
DECLARE
    v_cache regclass := to_regclass('pg_temp.pgtask_checked_queues');
    v_checked text[];
    v_new text[];
    v_missing text;
BEGIN
    -- The queues this transaction checked already, kept in a temporary table of this
    -- function's owner: the caller cannot write it, nor pass off a table of that name it
    -- made itself (a setting, as before, was anyone's to SET LOCAL).
    IF v_cache IS NULL THEN
        BEGIN
            CREATE TEMPORARY TABLE pgtask_checked_queues (name text PRIMARY KEY)
                ON COMMIT DELETE ROWS;
            v_cache := to_regclass('pg_temp.pgtask_checked_queues');
        EXCEPTION WHEN insufficient_privilege THEN
            NULL;  -- no TEMP on the database: every call checks
        END;
    ELSIF (SELECT pg_get_userbyid(c.relowner) FROM pg_class AS c WHERE c.oid = v_cache)
            IS DISTINCT FROM current_user THEN
        v_cache := NULL;
    END IF;
    IF v_cache IS NOT NULL THEN
        EXECUTE 'SELECT array_agg(name) FROM pg_temp.pgtask_checked_queues' INTO v_checked;
    END IF;
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
    IF v_cache IS NOT NULL THEN
        EXECUTE 'INSERT INTO pg_temp.pgtask_checked_queues (name) SELECT unnest($1)'
            ' ON CONFLICT DO NOTHING' USING v_new;
    END IF;
END
$$;
"""  # noqa: S608 (constants only)

_DOWN = r"""
CREATE OR REPLACE FUNCTION pgtask.queues_current(p_queues text[]) RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgtask, pg_temp AS $$
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

DROP TRIGGER idempotency_keys_taken_task ON pgtask.idempotency_keys;
DROP TRIGGER idempotency_keys_take_over ON pgtask.idempotency_keys;
DROP FUNCTION pgtask.key_taken_task();
DROP FUNCTION pgtask.key_take_over();
DROP TRIGGER tasks_delete_terminal ON pgtask.tasks;
DROP FUNCTION pgtask.task_delete_refused();
DROP TRIGGER checkpoints_immutable ON pgtask.checkpoints;
DROP FUNCTION pgtask.checkpoint_changed();
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
