"""pgtask 0015: the two raw-SQL powers revision 0014 left are refused; the run-now audit action.

Revision ID: pgtask_0015
Revises: pgtask_0014
Create Date: 2026-12-08

* ``idempotency_keys_reserved_task``: a constraint trigger checked at commit on every
  ``INSERT`` into ``pgtask.idempotency_keys`` runs ``pgtask.key_taken_task()`` (the check
  ``idempotency_keys_taken_task`` already makes for a take-over): unless the inserting role
  owns the schema, the reservation must then point at a task of the same queue that carries
  that key, or the commit fails with ``PT007``. A producer could reserve a key for no task
  (held for ever, every enqueue with it answered with a task that does not exist) or for
  another's task (a later enqueue answered with it). The library inserts the reservation
  and its task in one transaction, so its own enqueues pass.
* ``tasks_delete_terminal`` (``pgtask_0014``) is dropped, for the next trigger.
* ``tasks_delete_retained``: ``pgtask.task_delete_refused()`` now refuses (``PT006``), for every role but the owner, the
  deletion of a task that is not finished, or that finished less than its queue's terminal
  retention ago by ``pgtask.now()`` (``queues.terminal_retention_seconds``, 7 days when
  the queue has no row): the rule retention itself deletes by, so the worker and admin levels
  keep exactly the deletions retention makes.
* The audit log's action check allows ``schedule.run_now`` (an occurrence enqueued now by
  an operator, outside the schedule's cursor).
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0015"
down_revision = "pgtask_0014"
branch_labels = None
depends_on = None

_OWNER = (
    "pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class AS c"
    " WHERE c.oid = TG_RELID), 'MEMBER')"
)

_ACTIONS_BEFORE = (
    "'task.retry', 'task.cancel', 'queue.pause', 'queue.resume', 'queue.configure',"
    " 'schedule.set', 'schedule.pause', 'schedule.resume', 'schedule.delete'"
)
_ACTIONS = _ACTIONS_BEFORE + ", 'schedule.run_now'"

#: Kept equal to ``statements.DEFAULT_TERMINAL_RETENTION_SECONDS`` (a revision never imports
#: the package's current code: it must mean the same thing whenever it runs).
_DEFAULT_TERMINAL_RETENTION_SECONDS = 604_800

_UP = r"""
CREATE CONSTRAINT TRIGGER idempotency_keys_reserved_task
    AFTER INSERT ON pgtask.idempotency_keys
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    EXECUTE FUNCTION pgtask.key_taken_task();

DROP TRIGGER tasks_delete_terminal ON pgtask.tasks;

-- Invoker's rights on purpose: current_user is the role that runs the DELETE.
CREATE OR REPLACE FUNCTION pgtask.task_delete_refused() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    IF """ + _OWNER + r""" THEN
        RETURN OLD;
    END IF;
    IF OLD.state IN ('succeeded', 'failed', 'cancelled')
        AND OLD.completed_at <= pgtask.now() - make_interval(secs => coalesce(
            (SELECT q.terminal_retention_seconds FROM pgtask.queues AS q WHERE q.name = OLD.queue),
            """ + str(_DEFAULT_TERMINAL_RETENTION_SECONDS) + r"""))
    THEN
        RETURN OLD;
    END IF;
    IF OLD.state NOT IN ('succeeded', 'failed', 'cancelled') THEN
        RAISE EXCEPTION 'task % is %: only a finished task may be deleted', OLD.id, OLD.state
            USING ERRCODE = 'PT006',
                  HINT = 'Cancel it first; retention deletes finished tasks.';
    END IF;
    RAISE EXCEPTION 'task % finished within its queue''s terminal retention: it may not be deleted yet', OLD.id
        USING ERRCODE = 'PT006',
              HINT = 'Retention deletes it once its queue''s terminal_retention_seconds have passed.';
END
$$;

CREATE TRIGGER tasks_delete_retained
    BEFORE DELETE ON pgtask.tasks
    FOR EACH ROW
    EXECUTE FUNCTION pgtask.task_delete_refused();

ALTER TABLE pgtask.audit_log DROP CONSTRAINT ck_audit_log_action;
ALTER TABLE pgtask.audit_log ADD CONSTRAINT ck_audit_log_action CHECK (action IN (""" + _ACTIONS + r"""));
"""  # noqa: S608 (constants only)

_DOWN = r"""
-- The log is append-only: entries of the action stay, new ones are refused.
ALTER TABLE pgtask.audit_log DROP CONSTRAINT ck_audit_log_action;
ALTER TABLE pgtask.audit_log ADD CONSTRAINT ck_audit_log_action CHECK (action IN (""" + _ACTIONS_BEFORE + r""")) NOT VALID;

DROP TRIGGER tasks_delete_retained ON pgtask.tasks;

CREATE OR REPLACE FUNCTION pgtask.task_delete_refused() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
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

DROP TRIGGER idempotency_keys_reserved_task ON pgtask.idempotency_keys;
"""


def upgrade() -> None:
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
