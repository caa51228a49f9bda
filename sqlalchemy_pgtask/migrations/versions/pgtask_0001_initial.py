"""pgtask 0001: queues, tasks, attempts, idempotency keys, workers, handler policies.

Revision ID: pgtask_0001
Revises:
Create Date: 2026-11-30

Installs schema ``pgtask`` with the tables of the core queue and the triggers that keep its
invariants for every writer, not only for this library:

* ``tasks_notify_inserted`` / ``tasks_notify_pending``: a NOTIFY hint on channel
  ``pgtask_ready`` (payload: the queue name) when work becomes pending. One notification per
  queue per statement, since PostgreSQL takes a global lock at commit for each distinct one.
* ``tasks_admit_inserted`` / ``tasks_terminal_changed`` / ``tasks_capacity_deleted``: the O(1)
  outstanding-task counter of capacity-limited queues; over capacity raises SQLSTATE PT001.
  Queues without a limit are never locked.
* ``tasks_terminal_changed`` also sends a NOTIFY hint on channel ``pgtask_result`` (payload:
  the task id) when a task becomes terminal, for result waiters.
* ``tasks_idempotency_state`` / ``tasks_idempotency_deleted``: a key's reservation starts to
  expire when its task becomes terminal, and deleting task history never releases a key that
  has not expired.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "pgtask_0001"
down_revision = None
branch_labels = ("pgtask",)
depends_on = None

_TS = postgresql.TIMESTAMP(timezone=True)
_FAST_AUTOVACUUM = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_analyze_threshold": "1000",
}
_NOW = sa.text("statement_timestamp()")
_RETRY_SHAPE = (
    "(retry_kind IS NULL AND retry_base_seconds IS NULL AND retry_factor IS NULL AND retry_max_seconds IS NULL)"
    " OR (retry_kind = 'never' AND retry_base_seconds IS NULL AND retry_factor IS NULL AND retry_max_seconds IS NULL)"
    " OR (retry_kind = 'fixed' AND retry_base_seconds >= 0 AND retry_factor IS NULL AND retry_max_seconds IS NULL)"
    " OR (retry_kind = 'exponential' AND retry_base_seconds >= 0 AND retry_factor >= 1 AND retry_max_seconds >= retry_base_seconds)"
)

_TRIGGERS_UP = r"""
CREATE FUNCTION pgtask.notify_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pgtask_ready', q.queue)
    FROM (SELECT DISTINCT queue FROM inserted WHERE state = 'pending') AS q;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_notify_inserted
    AFTER INSERT ON pgtask.tasks
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION pgtask.notify_inserted();

CREATE FUNCTION pgtask.notify_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- PostgreSQL folds identical notifications within a transaction.
    PERFORM pg_notify('pgtask_ready', NEW.queue);
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_notify_pending
    AFTER UPDATE OF state, run_at ON pgtask.tasks
    FOR EACH ROW
    WHEN (NEW.state = 'pending' AND (OLD.state <> 'pending' OR OLD.run_at IS DISTINCT FROM NEW.run_at))
    EXECUTE FUNCTION pgtask.notify_pending();

CREATE FUNCTION pgtask.admit_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    over record;
BEGIN
    -- Lock limited queues in name order so concurrent multi-queue batches cannot deadlock.
    PERFORM 1 FROM pgtask.queues
    WHERE name IN (SELECT DISTINCT queue FROM inserted) AND max_outstanding_tasks IS NOT NULL
    ORDER BY name
    FOR NO KEY UPDATE;

    WITH demand AS (
        SELECT queue, count(*) AS n FROM inserted
        WHERE state IN ('pending', 'running', 'waiting')
        GROUP BY queue
    ), admitted AS (
        UPDATE pgtask.queues AS q
        SET outstanding_tasks = q.outstanding_tasks + demand.n
        FROM demand
        WHERE q.name = demand.queue AND q.max_outstanding_tasks IS NOT NULL
        RETURNING q.name, q.outstanding_tasks, q.max_outstanding_tasks
    )
    SELECT * INTO over FROM admitted
    WHERE outstanding_tasks > max_outstanding_tasks
    ORDER BY name
    LIMIT 1;

    IF FOUND THEN
        RAISE EXCEPTION 'queue % has reached its capacity of % outstanding tasks',
            over.name, over.max_outstanding_tasks
            USING ERRCODE = 'PT001', HINT = 'Capacity is back-pressure: retry the enqueue later.';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_admit_inserted
    AFTER INSERT ON pgtask.tasks
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION pgtask.admit_inserted();

CREATE FUNCTION pgtask.terminal_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    limited record;
BEGIN
    IF NEW.state IN ('succeeded', 'failed', 'cancelled') THEN
        -- Result waiters LISTEN on this channel; the payload is the finished task's id.
        PERFORM pg_notify('pgtask_result', NEW.id::text);
        UPDATE pgtask.queues
        SET outstanding_tasks = greatest(outstanding_tasks - 1, 0)
        WHERE name = NEW.queue AND max_outstanding_tasks IS NOT NULL;
    ELSE
        -- Back from terminal (an administrative retry) needs room like a new task.
        UPDATE pgtask.queues
        SET outstanding_tasks = outstanding_tasks + 1
        WHERE name = NEW.queue AND max_outstanding_tasks IS NOT NULL
        RETURNING name, outstanding_tasks, max_outstanding_tasks INTO limited;
        IF FOUND AND limited.outstanding_tasks > limited.max_outstanding_tasks THEN
            RAISE EXCEPTION 'queue % has reached its capacity of % outstanding tasks',
                limited.name, limited.max_outstanding_tasks
                USING ERRCODE = 'PT001', HINT = 'Capacity is back-pressure: retry later.';
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_terminal_changed
    AFTER UPDATE OF state ON pgtask.tasks
    FOR EACH ROW
    WHEN ((OLD.state IN ('succeeded', 'failed', 'cancelled')) <> (NEW.state IN ('succeeded', 'failed', 'cancelled')))
    EXECUTE FUNCTION pgtask.terminal_changed();

CREATE FUNCTION pgtask.capacity_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pgtask.queues
    SET outstanding_tasks = greatest(outstanding_tasks - 1, 0)
    WHERE name = OLD.queue AND max_outstanding_tasks IS NOT NULL;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_capacity_deleted
    AFTER DELETE ON pgtask.tasks
    FOR EACH ROW
    WHEN (OLD.state IN ('pending', 'running', 'waiting'))
    EXECUTE FUNCTION pgtask.capacity_deleted();

CREATE FUNCTION pgtask.idempotency_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('succeeded', 'failed', 'cancelled') THEN
        UPDATE pgtask.idempotency_keys AS k
        SET expires_at = NEW.completed_at + make_interval(secs => coalesce(
            (SELECT q.idempotency_retention_seconds FROM pgtask.queues AS q WHERE q.name = NEW.queue),
            2592000))
        WHERE k.queue = NEW.queue AND k.key = NEW.idempotency_key AND k.task_id = NEW.id;
    ELSE
        UPDATE pgtask.idempotency_keys AS k
        SET expires_at = NULL
        WHERE k.queue = NEW.queue AND k.key = NEW.idempotency_key AND k.task_id = NEW.id;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_idempotency_state
    AFTER UPDATE OF state ON pgtask.tasks
    FOR EACH ROW
    WHEN (NEW.idempotency_key IS NOT NULL
          AND (OLD.state IN ('succeeded', 'failed', 'cancelled')) <> (NEW.state IN ('succeeded', 'failed', 'cancelled')))
    EXECUTE FUNCTION pgtask.idempotency_state();

CREATE FUNCTION pgtask.idempotency_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Deleting history starts the retention clock if it had not started; it never releases.
    UPDATE pgtask.idempotency_keys AS k
    SET expires_at = coalesce(k.expires_at, statement_timestamp() + make_interval(secs => coalesce(
        (SELECT q.idempotency_retention_seconds FROM pgtask.queues AS q WHERE q.name = OLD.queue),
        2592000)))
    WHERE k.queue = OLD.queue AND k.key = OLD.idempotency_key AND k.task_id = OLD.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER tasks_idempotency_deleted
    AFTER DELETE ON pgtask.tasks
    FOR EACH ROW
    WHEN (OLD.idempotency_key IS NOT NULL)
    EXECUTE FUNCTION pgtask.idempotency_deleted();
"""

_FUNCTIONS = (
    "notify_inserted", "notify_pending", "admit_inserted", "terminal_changed",
    "capacity_deleted", "idempotency_state", "idempotency_deleted",
)


def upgrade() -> None:
    op.execute("CREATE SCHEMA IF NOT EXISTS pgtask")
    op.create_table(
        "queues",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("terminal_retention_seconds", sa.BigInteger(), server_default=sa.text("604800"), nullable=False),
        sa.Column("idempotency_retention_seconds", sa.BigInteger(), server_default=sa.text("2592000"), nullable=False),
        sa.Column("max_outstanding_tasks", sa.BigInteger(), nullable=True),
        sa.Column("outstanding_tasks", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("paused_at", _TS, nullable=True),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("updated_at", _TS, server_default=_NOW, nullable=False),
        sa.CheckConstraint("name ~ '^[A-Za-z0-9._:-]+$' AND octet_length(name) <= 128", name=op.f("ck_queues_name")),
        sa.CheckConstraint("idempotency_retention_seconds >= 0", name=op.f("ck_queues_idempotency_retention")),
        sa.CheckConstraint("max_outstanding_tasks IS NULL OR max_outstanding_tasks > 0", name=op.f("ck_queues_capacity")),
        sa.CheckConstraint("outstanding_tasks >= 0", name=op.f("ck_queues_outstanding_tasks")),
        sa.CheckConstraint("terminal_retention_seconds >= 0", name=op.f("ck_queues_terminal_retention")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_queues")),
        schema="pgtask",
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("headers", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("state", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("run_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("failed_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default=sa.text("5"), nullable=False),
        sa.Column("lease_token", sa.UUID(), nullable=True),
        sa.Column("lease_owner", sa.UUID(), nullable=True),
        sa.Column("lease_expires_at", _TS, nullable=True),
        sa.Column("cancel_requested_at", _TS, nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("result", postgresql.JSONB(), nullable=True),
        sa.Column("error", postgresql.JSONB(), nullable=True),
        sa.Column("parent_id", sa.UUID(), nullable=True),
        sa.Column("retry_kind", sa.Text(), nullable=True),
        sa.Column("retry_base_seconds", sa.Double(), nullable=True),
        sa.Column("retry_factor", sa.Double(), nullable=True),
        sa.Column("retry_max_seconds", sa.Double(), nullable=True),
        sa.Column("retry_jitter", sa.Boolean(), nullable=True),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("updated_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("completed_at", _TS, nullable=True),
        sa.CheckConstraint(_RETRY_SHAPE, name=op.f("ck_tasks_retry_policy")),
        sa.CheckConstraint("(state IN ('succeeded', 'failed', 'cancelled')) = (completed_at IS NOT NULL)", name=op.f("ck_tasks_completed_at")),
        sa.CheckConstraint("jsonb_typeof(headers) = 'object' AND octet_length(headers::text) <= 65536", name=op.f("ck_tasks_headers")),
        sa.CheckConstraint("name ~ '^[A-Za-z0-9._:-]+$' AND octet_length(name) <= 255", name=op.f("ck_tasks_name")),
        sa.CheckConstraint("queue ~ '^[A-Za-z0-9._:-]+$' AND octet_length(queue) <= 128", name=op.f("ck_tasks_queue")),
        sa.CheckConstraint("state <> 'running' OR (lease_token IS NOT NULL AND lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)", name=op.f("ck_tasks_lease")),
        sa.CheckConstraint("state IN ('pending', 'running', 'waiting', 'succeeded', 'failed', 'cancelled')", name=op.f("ck_tasks_state")),
        sa.CheckConstraint("attempt >= 0", name=op.f("ck_tasks_attempt")),
        sa.CheckConstraint("error IS NULL OR octet_length(error::text) <= 262144", name=op.f("ck_tasks_error_size")),
        sa.CheckConstraint("failed_attempts >= 0 AND failed_attempts <= attempt", name=op.f("ck_tasks_failed")),
        sa.CheckConstraint("max_attempts > 0", name=op.f("ck_tasks_max_attempts")),
        sa.CheckConstraint("octet_length(payload::text) <= 1048576", name=op.f("ck_tasks_payload_size")),
        sa.CheckConstraint("parent_id IS NULL OR parent_id <> id", name=op.f("ck_tasks_parent")),
        sa.CheckConstraint("result IS NULL OR octet_length(result::text) <= 1048576", name=op.f("ck_tasks_result_size")),
        sa.CheckConstraint("version > 0", name=op.f("ck_tasks_version")),
        sa.ForeignKeyConstraint(["parent_id"], ["pgtask.tasks.id"], name=op.f("fk_tasks_parent_id_tasks"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
        schema="pgtask",
        postgresql_with=_FAST_AUTOVACUUM,
    )
    op.create_index("ix_tasks_claim", "tasks", ["queue", sa.literal_column("priority DESC"), "run_at", "id"], schema="pgtask", postgresql_where=sa.text("state = 'pending'"))
    op.create_index("ix_tasks_pending_run_at", "tasks", ["queue", "run_at"], schema="pgtask", postgresql_where=sa.text("state = 'pending'"))
    op.create_index("ix_tasks_lease_expiry", "tasks", ["lease_expires_at", "id"], schema="pgtask", postgresql_where=sa.text("state = 'running'"))
    op.create_index("ix_tasks_outstanding", "tasks", ["queue", "state"], schema="pgtask", postgresql_where=sa.text("state IN ('pending', 'running', 'waiting')"))
    op.create_index("ix_tasks_parent", "tasks", ["parent_id"], schema="pgtask", postgresql_where=sa.text("parent_id IS NOT NULL"))
    op.create_table(
        "attempts",
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("lease_token", sa.UUID(), nullable=False),
        sa.Column("worker_id", sa.UUID(), nullable=True),
        sa.Column("state", sa.Text(), server_default=sa.text("'running'"), nullable=False),
        sa.Column("started_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
        sa.Column("error", postgresql.JSONB(), nullable=True),
        sa.CheckConstraint("state IN ('running', 'succeeded', 'failed', 'lost', 'cancelled', 'suspended', 'released')", name=op.f("ck_attempts_state")),
        sa.CheckConstraint("attempt > 0", name=op.f("ck_attempts_attempt")),
        sa.CheckConstraint("error IS NULL OR octet_length(error::text) <= 262144", name=op.f("ck_attempts_error_size")),
        sa.ForeignKeyConstraint(["task_id"], ["pgtask.tasks.id"], name=op.f("fk_attempts_task_id_tasks"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("task_id", "attempt", name=op.f("pk_attempts")),
        schema="pgtask",
        postgresql_with=_FAST_AUTOVACUUM,
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("expires_at", _TS, nullable=True),
        sa.CheckConstraint("octet_length(key) BETWEEN 1 AND 512", name=op.f("ck_idempotency_keys_key")),
        sa.PrimaryKeyConstraint("queue", "key", name=op.f("pk_idempotency_keys")),
        schema="pgtask",
    )
    op.create_index("ix_idempotency_keys_expiry", "idempotency_keys", ["expires_at"], schema="pgtask", postgresql_where=sa.text("expires_at IS NOT NULL"))
    op.create_table(
        "workers",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("queues", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("version", sa.Text(), nullable=False),
        sa.Column("hostname", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("draining", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("started_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("heartbeat_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        schema="pgtask",
    )
    op.create_index("ix_workers_expires_at", "workers", ["expires_at"], schema="pgtask")
    op.create_table(
        "worker_capabilities",
        sa.Column("worker_id", sa.UUID(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["worker_id"], ["pgtask.workers.id"], name=op.f("fk_worker_capabilities_worker_id_workers"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("worker_id", "queue", "name", "version", name=op.f("pk_worker_capabilities")),
        schema="pgtask",
    )
    op.create_table(
        "handler_policies",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("retry_kind", sa.Text(), nullable=False),
        sa.Column("retry_base_seconds", sa.Double(), nullable=True),
        sa.Column("retry_factor", sa.Double(), nullable=True),
        sa.Column("retry_max_seconds", sa.Double(), nullable=True),
        sa.Column("retry_jitter", sa.Boolean(), nullable=False),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.CheckConstraint(_RETRY_SHAPE, name=op.f("ck_handler_policies_retry_policy")),
        sa.CheckConstraint("retry_kind IN ('never', 'fixed', 'exponential')", name=op.f("ck_handler_policies_retry_kind")),
        sa.PrimaryKeyConstraint("queue", "name", "version", name=op.f("pk_handler_policies")),
        schema="pgtask",
    )
    op.execute(_TRIGGERS_UP)


def downgrade() -> None:
    for table in (
        "handler_policies", "worker_capabilities", "workers", "idempotency_keys", "attempts",
        "tasks", "queues",
    ):
        op.drop_table(table, schema="pgtask")
    for function in _FUNCTIONS:
        op.execute(f"DROP FUNCTION pgtask.{function}()")
    # The schema may also hold the standalone migrator's version table; drop it only if empty.
    op.execute(
        """
        DO $$
        BEGIN
            IF NOT EXISTS (
                SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = 'pgtask'
            ) THEN
                DROP SCHEMA pgtask;
            END IF;
        END
        $$
        """
    )
