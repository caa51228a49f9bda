"""pgtask 0003: durable execution: checkpoints, signals, waits, and cascading cancellation.

Revision ID: pgtask_0003
Revises: pgtask_0002
Create Date: 2026-12-01

* Tables ``checkpoints`` (the stored outcome of each durable call, first value wins),
  ``signals`` (immutable events addressed to a task) and ``waits`` (what a ``waiting`` task
  waits for); column ``tasks.has_children``.
* ``signals_resolve_wait``: a signal wakes the task waiting for it, in the emitter's
  transaction. It runs after the foreign-key check, which waits for a task row locked by a
  wait being registered, so a signal and a wait never miss each other.
* Lock order: every change of a waiting task locks the task row before it reads or deletes
  the task's wait (the triggers, the timeout pass, cancellation). A task that ends locks its
  descendants after itself; a child that ends locks its waiting parent after itself, with
  ``NOWAIT`` (SQLSTATE 55P03 when the parent is held, and the writer tries again), so the two
  never deadlock.
* ``tasks_child_finished``: a child that becomes terminal wakes its parent waiting for its
  result, with the child's state, result and error as the parent's checkpoint; under
  REPEATABLE READ or SERIALIZABLE it always locks the parent, so a wait registered after the
  snapshot raises a serialization error instead of being missed.
* ``tasks_left_waiting``: a task that leaves ``waiting`` by any path (woken, timed out,
  cancelled) loses its wait row, so no stale wait fires later.
* ``tasks_cancel_descendants``: a task that becomes terminal by any path (success, failure,
  cancellation, an administrator) cancels its unfinished descendants: pending and waiting
  ones at once, running ones by a cancel request their worker acts on.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "pgtask_0003"
down_revision = "pgtask_0002"
branch_labels = None
depends_on = None

_TS = postgresql.TIMESTAMP(timezone=True)
_NOW = sa.text("statement_timestamp()")
_KINDS = "('step', 'sleep', 'signal', 'spawn', 'result', 'transaction')"

_UP = r"""
CREATE FUNCTION pgtask.signal_arrived() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    w pgtask.waits%ROWTYPE;
BEGIN
    -- Most signals arrive with nobody waiting for them: look before locking anything.
    PERFORM 1 FROM pgtask.waits
    WHERE task_id = NEW.task_id AND kind = 'signal'
      AND signal_name = NEW.name AND signal_occurrence = NEW.occurrence;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Every change of a waiting task locks the task row first, then reads its wait.
    PERFORM 1 FROM pgtask.tasks WHERE id = NEW.task_id FOR NO KEY UPDATE;
    SELECT * INTO w FROM pgtask.waits
    WHERE task_id = NEW.task_id AND kind = 'signal'
      AND signal_name = NEW.name AND signal_occurrence = NEW.occurrence;
    IF FOUND THEN
        INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)
        VALUES (w.task_id, w.version, w.step, w.occurrence, 'signal',
                jsonb_build_object('signal', NEW.value))
        ON CONFLICT DO NOTHING;
        UPDATE pgtask.tasks SET state = 'pending', run_at = pgtask.now(), updated_at = pgtask.now()
        WHERE id = w.task_id AND state = 'waiting';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER signals_resolve_wait
    AFTER INSERT ON pgtask.signals
    FOR EACH ROW EXECUTE FUNCTION pgtask.signal_arrived();

CREATE FUNCTION pgtask.child_finished() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    w pgtask.waits%ROWTYPE;
BEGIN
    -- Under READ COMMITTED each statement here sees what committed before it began, so a
    -- parent that does not wait for this child needs no lock. Under a snapshot isolation a
    -- wait registered after the snapshot would be invisible: lock the parent first, which
    -- fails with a serialization error if its row changed since (registering a wait changes
    -- it), and the caller's retry then sees the wait.
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM pgtask.waits
        WHERE task_id = NEW.parent_id AND kind = 'child' AND child_id = NEW.id;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    -- A child is locked before its parent here, a parent before its children where a task
    -- ends (tasks_cancel_descendants): never wait for the parent, or the two could deadlock.
    -- Whoever holds it holds it briefly or is ending it; this statement fails at once with
    -- SQLSTATE 55P03 instead, and is tried again (the worker writes outcomes again).
    PERFORM 1 FROM pgtask.tasks WHERE id = NEW.parent_id FOR NO KEY UPDATE NOWAIT;
    -- Only a parent still waiting: one ending in this very statement (its cancellation
    -- cascading to this child) keeps its wait row until tasks_left_waiting fires.
    SELECT w0.* INTO w FROM pgtask.waits AS w0
    JOIN pgtask.tasks AS p ON p.id = w0.task_id AND p.state = 'waiting'
    WHERE w0.task_id = NEW.parent_id AND w0.kind = 'child' AND w0.child_id = NEW.id;
    IF FOUND THEN
        INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)
        VALUES (w.task_id, w.version, w.step, w.occurrence, 'result',
                jsonb_build_object('state', NEW.state, 'result', NEW.result, 'error', NEW.error))
        ON CONFLICT DO NOTHING;
        UPDATE pgtask.tasks SET state = 'pending', run_at = pgtask.now(), updated_at = pgtask.now()
        WHERE id = w.task_id AND state = 'waiting';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_child_finished
    AFTER UPDATE OF state ON pgtask.tasks
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL
          AND NEW.state IN ('succeeded', 'failed', 'cancelled')
          AND OLD.state NOT IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION pgtask.child_finished();

CREATE FUNCTION pgtask.left_waiting() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM pgtask.waits WHERE task_id = NEW.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_left_waiting
    AFTER UPDATE OF state ON pgtask.tasks
    FOR EACH ROW
    WHEN (OLD.state = 'waiting' AND NEW.state <> 'waiting')
    EXECUTE FUNCTION pgtask.left_waiting();

CREATE FUNCTION pgtask.cancel_descendants() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE TRIGGER tasks_cancel_descendants
    AFTER UPDATE OF state ON pgtask.tasks
    FOR EACH ROW
    WHEN (NEW.has_children
          AND NEW.state IN ('succeeded', 'failed', 'cancelled')
          AND OLD.state NOT IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION pgtask.cancel_descendants();
"""

_DOWN = r"""
DROP TRIGGER tasks_cancel_descendants ON pgtask.tasks;
DROP FUNCTION pgtask.cancel_descendants();
DROP TRIGGER tasks_left_waiting ON pgtask.tasks;
DROP FUNCTION pgtask.left_waiting();
DROP TRIGGER tasks_child_finished ON pgtask.tasks;
DROP FUNCTION pgtask.child_finished();
DROP TRIGGER signals_resolve_wait ON pgtask.signals;
DROP FUNCTION pgtask.signal_arrived();
"""


def upgrade() -> None:
    op.add_column(
        "tasks",
        sa.Column("has_children", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        schema="pgtask",
    )
    op.create_table(
        "checkpoints",
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("step", sa.Text(), nullable=False),
        sa.Column("occurrence", sa.Integer(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("value", postgresql.JSONB(), nullable=False),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.CheckConstraint("octet_length(step) BETWEEN 1 AND 255", name=op.f("ck_checkpoints_step")),
        sa.CheckConstraint("occurrence >= 0", name=op.f("ck_checkpoints_occurrence")),
        sa.CheckConstraint(f"kind IN {_KINDS}", name=op.f("ck_checkpoints_kind")),
        sa.CheckConstraint("octet_length(value::text) <= 2097152", name=op.f("ck_checkpoints_value_size")),
        sa.ForeignKeyConstraint(["task_id"], ["pgtask.tasks.id"], name=op.f("fk_checkpoints_task_id_tasks"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("task_id", "version", "step", "occurrence", name=op.f("pk_checkpoints")),
        schema="pgtask",
    )
    op.create_table(
        "signals",
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("occurrence", sa.Integer(), nullable=False),
        sa.Column("value", postgresql.JSONB(), nullable=False),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.CheckConstraint("name ~ '^[A-Za-z0-9._:-]+$' AND octet_length(name) <= 255", name=op.f("ck_signals_name")),
        sa.CheckConstraint("occurrence >= 0", name=op.f("ck_signals_occurrence")),
        sa.CheckConstraint("octet_length(value::text) <= 1048576", name=op.f("ck_signals_value_size")),
        sa.ForeignKeyConstraint(["task_id"], ["pgtask.tasks.id"], name=op.f("fk_signals_task_id_tasks"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("task_id", "name", "occurrence", name=op.f("pk_signals")),
        schema="pgtask",
    )
    op.create_table(
        "waits",
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("step", sa.Text(), nullable=False),
        sa.Column("occurrence", sa.Integer(), nullable=False),
        sa.Column("signal_name", sa.Text(), nullable=True),
        sa.Column("signal_occurrence", sa.Integer(), nullable=True),
        sa.Column("child_id", sa.UUID(), nullable=True),
        sa.Column("timeout_at", _TS, nullable=True),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.CheckConstraint("kind IN ('signal', 'child')", name=op.f("ck_waits_kind")),
        sa.CheckConstraint("octet_length(step) BETWEEN 1 AND 255", name=op.f("ck_waits_step")),
        sa.CheckConstraint("(kind = 'signal') = (signal_name IS NOT NULL AND signal_occurrence IS NOT NULL)", name=op.f("ck_waits_signal")),
        sa.CheckConstraint("(kind = 'child') = (child_id IS NOT NULL)", name=op.f("ck_waits_child")),
        sa.ForeignKeyConstraint(["task_id"], ["pgtask.tasks.id"], name=op.f("fk_waits_task_id_tasks"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_waits")),
        schema="pgtask",
    )
    op.create_index("ix_waits_timeout_at", "waits", ["timeout_at"], schema="pgtask", postgresql_where=sa.text("timeout_at IS NOT NULL"))
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
    op.drop_table("waits", schema="pgtask")
    op.drop_table("signals", schema="pgtask")
    op.drop_table("checkpoints", schema="pgtask")
    op.drop_column("tasks", "has_children", schema="pgtask")
