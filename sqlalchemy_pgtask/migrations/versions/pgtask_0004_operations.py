"""pgtask 0004: operations: schedules, retention, audit, time limits, rate limits, starvation, roles.

Revision ID: pgtask_0004
Revises: pgtask_0003
Create Date: 2026-12-01

* Table ``schedules``: cron or interval definitions with a cursor (``next_run_at``) that any
  worker advances in the transaction that inserts the occurrence's task. Tasks record their
  ``(schedule_name, scheduled_for)``, unique, so racing materialisers create each occurrence once.
* Table ``audit_log``: an append-only record of administrative actions, with no foreign keys
  so entries outlive what they name; ``audit_log_immutable`` refuses UPDATE and DELETE,
  ``audit_log_no_truncate`` refuses TRUNCATE.
* Per-task ``timeout_seconds`` and per-attempt ``deadline_at`` (database time) for time limits.
* Per-queue rate limits (``rate_limit`` starts per ``rate_period_seconds``) with their token
  buckets in ``rate_buckets`` (kept apart from ``queues`` so claims never contend with the
  capacity counter), and ``starvation_timeout_seconds``.
* ``workers.lock_key``: the advisory lock every connection of a live worker holds (shared); a
  worker whose lock is gone has died, and its tasks are rescued at once instead of at lease
  expiry.
* ``ix_tasks_finished`` becomes ``(queue, completed_at, state)``: retention reads a queue's
  expired history as one range, oldest first.
* The trigger functions that write rows on behalf of whoever fired them run as their owner
  (``SECURITY DEFINER`` with a fixed ``search_path``), so least-privilege roles need no
  privilege on the tables those triggers maintain; the two such functions a role could call
  directly are no longer executable by PUBLIC.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "pgtask_0004"
down_revision = "pgtask_0003"
branch_labels = None
depends_on = None

_TS = postgresql.TIMESTAMP(timezone=True)
_NOW = sa.text("statement_timestamp()")
_NAME = "~ '^[A-Za-z0-9._:-]+$'"
_TERMINAL = "('succeeded', 'failed', 'cancelled')"
_ACTIONS = (
    "'task.retry', 'task.cancel', 'queue.pause', 'queue.resume', 'queue.configure',"
    " 'schedule.set', 'schedule.pause', 'schedule.resume', 'schedule.delete'"
)

#: Trigger functions that write to tables the firing role may not be granted.
_DEFINER_FUNCTIONS = (
    "admit_inserted()", "admit(text[], bigint[])", "terminal_changed()", "capacity_deleted()",
    "idempotency_deleted()", "recount_outstanding(text)", "queue_capacity_changed()",
    "queue_capacity_created()", "signal_arrived()", "child_finished()", "left_waiting()",
    "cancel_descendants()",
)

#: The definer functions a role could call directly (trigger functions cannot be).
_CALLABLE_DEFINERS = ("admit(text[], bigint[])", "recount_outstanding(text)")

_UP = r"""
CREATE FUNCTION pgtask.audit_log_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'pgtask.audit_log is append-only'
        USING ERRCODE = 'PT003', HINT = 'Audit entries are never changed or deleted.';
END
$$;

CREATE TRIGGER audit_log_immutable
    BEFORE UPDATE OR DELETE ON pgtask.audit_log
    FOR EACH ROW EXECUTE FUNCTION pgtask.audit_log_immutable();

CREATE TRIGGER audit_log_no_truncate
    BEFORE TRUNCATE ON pgtask.audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION pgtask.audit_log_immutable();
"""

_DOWN = r"""
DROP TRIGGER audit_log_no_truncate ON pgtask.audit_log;
DROP TRIGGER audit_log_immutable ON pgtask.audit_log;
DROP FUNCTION pgtask.audit_log_immutable();
"""


def upgrade() -> None:
    op.add_column("queues", sa.Column("rate_limit", sa.Integer(), nullable=True), schema="pgtask")
    op.add_column("queues", sa.Column("rate_period_seconds", sa.Double(), nullable=True), schema="pgtask")
    op.add_column("queues", sa.Column("starvation_timeout_seconds", sa.Double(), nullable=True), schema="pgtask")
    op.create_check_constraint(op.f("ck_queues_rate_limit"), "queues", "(rate_limit IS NULL) = (rate_period_seconds IS NULL) AND (rate_limit IS NULL OR rate_limit > 0) AND (rate_period_seconds IS NULL OR (rate_period_seconds > 0 AND rate_period_seconds <= 3155760000))", schema="pgtask")
    op.create_check_constraint(op.f("ck_queues_starvation_timeout"), "queues", "starvation_timeout_seconds IS NULL OR (starvation_timeout_seconds > 0 AND starvation_timeout_seconds <= 3155760000)", schema="pgtask")
    op.create_table(
        "rate_buckets",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Double(), nullable=False),
        sa.Column("refilled_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("queue", name=op.f("pk_rate_buckets")),
        schema="pgtask",
    )

    op.add_column("tasks", sa.Column("timeout_seconds", sa.Double(), nullable=True), schema="pgtask")
    op.add_column("tasks", sa.Column("schedule_name", sa.Text(), nullable=True), schema="pgtask")
    op.add_column("tasks", sa.Column("scheduled_for", _TS, nullable=True), schema="pgtask")
    op.create_check_constraint(op.f("ck_tasks_timeout"), "tasks", "timeout_seconds IS NULL OR (timeout_seconds > 0 AND timeout_seconds <= 3155760000)", schema="pgtask")
    op.create_check_constraint(op.f("ck_tasks_schedule"), "tasks", "(schedule_name IS NULL) = (scheduled_for IS NULL)", schema="pgtask")
    op.create_index("ix_tasks_schedule_occurrence", "tasks", ["schedule_name", "scheduled_for"], unique=True, schema="pgtask", postgresql_where=sa.text("schedule_name IS NOT NULL"))
    op.drop_index("ix_tasks_finished", table_name="tasks", schema="pgtask")
    op.create_index("ix_tasks_finished", "tasks", ["queue", "completed_at", "state"], schema="pgtask", postgresql_where=sa.text(f"state IN {_TERMINAL}"))
    op.add_column("attempts", sa.Column("deadline_at", _TS, nullable=True), schema="pgtask")
    op.add_column("workers", sa.Column("lock_key", sa.Integer(), nullable=True), schema="pgtask")

    op.create_table(
        "schedules",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=True),
        sa.Column("interval_seconds", sa.Double(), nullable=True),
        sa.Column("timezone", sa.Text(), server_default=sa.text("'UTC'"), nullable=False),
        sa.Column("misfire", sa.Text(), server_default=sa.text("'latest'"), nullable=False),
        sa.Column("catch_up_limit", sa.Integer(), nullable=True),
        sa.Column("overlap", sa.Text(), server_default=sa.text("'allow'"), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("task_name", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("payload", postgresql.JSONB(), server_default=sa.text("'null'::jsonb"), nullable=False),
        sa.Column("headers", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=True),
        sa.Column("timeout_seconds", sa.Double(), nullable=True),
        sa.Column("declared", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("next_run_at", _TS, nullable=False),
        sa.Column("last_task_id", sa.UUID(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("paused_at", _TS, nullable=True),
        sa.Column("created_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("updated_at", _TS, server_default=_NOW, nullable=False),
        sa.CheckConstraint(f"name {_NAME} AND octet_length(name) <= 255", name=op.f("ck_schedules_name")),
        sa.CheckConstraint("(cron IS NULL) <> (interval_seconds IS NULL)", name=op.f("ck_schedules_kind")),
        sa.CheckConstraint("cron IS NULL OR octet_length(cron) BETWEEN 1 AND 255", name=op.f("ck_schedules_cron")),
        sa.CheckConstraint("interval_seconds IS NULL OR (interval_seconds >= 1 AND interval_seconds <= 3155760000)", name=op.f("ck_schedules_interval")),
        sa.CheckConstraint("octet_length(timezone) BETWEEN 1 AND 64", name=op.f("ck_schedules_timezone")),
        sa.CheckConstraint("misfire IN ('skip', 'latest', 'catch_up')", name=op.f("ck_schedules_misfire")),
        sa.CheckConstraint("(misfire = 'catch_up') = (catch_up_limit IS NOT NULL) AND (catch_up_limit IS NULL OR catch_up_limit BETWEEN 1 AND 10000)", name=op.f("ck_schedules_catch_up")),
        sa.CheckConstraint("overlap IN ('allow', 'skip')", name=op.f("ck_schedules_overlap")),
        sa.CheckConstraint(f"queue {_NAME} AND octet_length(queue) <= 128", name=op.f("ck_schedules_queue")),
        sa.CheckConstraint(f"task_name {_NAME} AND octet_length(task_name) <= 255", name=op.f("ck_schedules_task_name")),
        sa.CheckConstraint("version > 0", name=op.f("ck_schedules_version")),
        sa.CheckConstraint("octet_length(payload::text) <= 1048576", name=op.f("ck_schedules_payload_size")),
        sa.CheckConstraint("jsonb_typeof(headers) = 'object' AND octet_length(headers::text) <= 65536", name=op.f("ck_schedules_headers")),
        sa.CheckConstraint("max_attempts IS NULL OR max_attempts > 0", name=op.f("ck_schedules_max_attempts")),
        sa.CheckConstraint("timeout_seconds IS NULL OR (timeout_seconds > 0 AND timeout_seconds <= 3155760000)", name=op.f("ck_schedules_timeout")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_schedules")),
        schema="pgtask",
    )
    op.create_index("ix_schedules_due", "schedules", ["next_run_at"], schema="pgtask", postgresql_where=sa.text("paused_at IS NULL"))

    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("occurred_at", _TS, server_default=_NOW, nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=True),
        sa.Column("queue", sa.Text(), nullable=True),
        sa.Column("schedule", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("details", postgresql.JSONB(), nullable=True),
        sa.CheckConstraint("octet_length(actor) BETWEEN 1 AND 255", name=op.f("ck_audit_log_actor")),
        sa.CheckConstraint(f"action IN ({_ACTIONS})", name=op.f("ck_audit_log_action")),
        sa.CheckConstraint("reason IS NULL OR octet_length(reason) <= 1000", name=op.f("ck_audit_log_reason")),
        sa.CheckConstraint("details IS NULL OR octet_length(details::text) <= 65536", name=op.f("ck_audit_log_details_size")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
        schema="pgtask",
    )
    op.create_index("ix_audit_log_task_id", "audit_log", ["task_id"], schema="pgtask", postgresql_where=sa.text("task_id IS NOT NULL"))
    op.create_index("ix_audit_log_occurred_at", "audit_log", ["occurred_at"], schema="pgtask")
    op.execute(_UP)
    for function in _DEFINER_FUNCTIONS:
        op.execute(
            f"ALTER FUNCTION pgtask.{function} SECURITY DEFINER"
            " SET search_path = pg_catalog, pgtask, pg_temp"
        )
    # Only triggers call these; run by hand as their owner they could lock pgtask.tasks.
    for function in _CALLABLE_DEFINERS:
        op.execute(f"REVOKE EXECUTE ON FUNCTION pgtask.{function} FROM PUBLIC")


def downgrade() -> None:
    for function in _CALLABLE_DEFINERS:
        op.execute(f"GRANT EXECUTE ON FUNCTION pgtask.{function} TO PUBLIC")
    for function in _DEFINER_FUNCTIONS:
        op.execute(f"ALTER FUNCTION pgtask.{function} SECURITY INVOKER RESET search_path")
    op.execute(_DOWN)
    op.drop_index("ix_audit_log_occurred_at", table_name="audit_log", schema="pgtask")
    op.drop_index("ix_audit_log_task_id", table_name="audit_log", schema="pgtask")
    op.drop_table("audit_log", schema="pgtask")
    op.drop_index("ix_schedules_due", table_name="schedules", schema="pgtask")
    op.drop_table("schedules", schema="pgtask")
    op.drop_column("workers", "lock_key", schema="pgtask")
    op.drop_column("attempts", "deadline_at", schema="pgtask")
    op.drop_index("ix_tasks_finished", table_name="tasks", schema="pgtask")
    op.create_index("ix_tasks_finished", "tasks", ["queue", "state", "completed_at"], schema="pgtask", postgresql_where=sa.text(f"state IN {_TERMINAL}"))
    op.drop_index("ix_tasks_schedule_occurrence", table_name="tasks", schema="pgtask")
    op.drop_constraint(op.f("ck_tasks_schedule"), "tasks", schema="pgtask")
    op.drop_constraint(op.f("ck_tasks_timeout"), "tasks", schema="pgtask")
    op.drop_column("tasks", "scheduled_for", schema="pgtask")
    op.drop_column("tasks", "schedule_name", schema="pgtask")
    op.drop_column("tasks", "timeout_seconds", schema="pgtask")
    op.drop_table("rate_buckets", schema="pgtask")
    op.drop_constraint(op.f("ck_queues_starvation_timeout"), "queues", schema="pgtask")
    op.drop_constraint(op.f("ck_queues_rate_limit"), "queues", schema="pgtask")
    op.drop_column("queues", "starvation_timeout_seconds", schema="pgtask")
    op.drop_column("queues", "rate_period_seconds", schema="pgtask")
    op.drop_column("queues", "rate_limit", schema="pgtask")
