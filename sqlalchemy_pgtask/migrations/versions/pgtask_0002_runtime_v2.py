"""pgtask 0002: database time as one function, lock-free completions, capacity for every writer.

Revision ID: pgtask_0002
Revises: pgtask_0001
Create Date: 2026-12-01

* ``pgtask.now()``: the one expression of database time every statement uses. It is
  ``statement_timestamp()``, inlined by the planner; tests replace its body to move the clock
  of a whole database (``sqlalchemy_pgtask.testing.move_database_clock``).
* ``pgtask.capacity_releases``: a task of a capacity-limited queue that finishes (or is
  deleted while outstanding) appends a release row instead of decrementing the queue's
  counter, so a completion never waits for a producer that holds the queue row for the rest
  of its business transaction. Admission (``pgtask.admit``) folds the releases into the
  counter under the lock it takes anyway.
* ``tasks_idempotency_state`` is dropped: a finished task no longer touches its key's row
  (which a producer's duplicate enqueue may hold). A reservation's expiry is derived from its
  task (``completed_at`` + the queue's idempotency retention) until the task is deleted, when
  the delete trigger of 0001 writes it down.
* ``queues_capacity_created`` / ``queues_capacity_changed``: turning a capacity limit on
  (through any writer, ORM ``session.add(Queue(...))`` included) recounts the outstanding
  tasks exactly, refuses to do so outside READ COMMITTED (where the count would come from a
  stale snapshot, SQLSTATE PT002), and gives up after 3 s of waiting for the table lock the
  recount needs (SQLSTATE 55P03) rather than queue every writer of ``pgtask.tasks`` behind it.
* ``queues_resumed``: resuming a paused queue sends the ``pgtask_ready`` hint, so idle workers
  claim at once instead of at their next poll.
* ``tasks.max_attempts`` may be NULL until the first claim, which takes the registered
  handler's ``max_attempts``; ``handler_policies.max_attempts`` freezes it with the retry
  policy (NULL for policies frozen before this revision, until a worker registers them).
  Downgrading gives unclaimed tasks without their own value the old default of 5.
* ``ix_tasks_finished``: terminal tasks by queue and state, for status counts and retention.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "pgtask_0002"
down_revision = "pgtask_0001"
branch_labels = None
depends_on = None

_TERMINAL = "('succeeded', 'failed', 'cancelled')"

_UP = r"""
CREATE FUNCTION pgtask.now() RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT statement_timestamp() $$;

COMMENT ON FUNCTION pgtask.now() IS
    'Database time for every pgtask deadline (statement_timestamp()); tests replace it to move the clock.';

-- Capacity admission for the given queues: lock the limited ones in name order (concurrent
-- multi-queue batches cannot deadlock), fold their releases, add the demand, check the limit.
CREATE FUNCTION pgtask.admit(p_queues text[], p_counts bigint[]) RETURNS void
    LANGUAGE plpgsql AS $$
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
$$;

CREATE OR REPLACE FUNCTION pgtask.admit_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_queues text[];
    v_counts bigint[];
BEGIN
    SELECT array_agg(d.queue ORDER BY d.queue), array_agg(d.n ORDER BY d.queue)
    INTO v_queues, v_counts
    FROM (
        SELECT queue, count(*) AS n FROM inserted
        WHERE state IN ('pending', 'running', 'waiting')
        GROUP BY queue
    ) AS d;
    IF v_queues IS NOT NULL THEN
        PERFORM pgtask.admit(v_queues, v_counts);
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION pgtask.terminal_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('succeeded', 'failed', 'cancelled') THEN
        -- Result waiters LISTEN on this channel; the payload is the finished task's id.
        PERFORM pg_notify('pgtask_result', NEW.id::text);
        -- A plain read of the queue row: it never waits for a producer holding it.
        INSERT INTO pgtask.capacity_releases (queue, released)
        SELECT q.name, 1 FROM pgtask.queues AS q
        WHERE q.name = NEW.queue AND q.max_outstanding_tasks IS NOT NULL;
    ELSE
        -- Back from terminal (an administrative retry) needs room like a new task.
        PERFORM pgtask.admit(ARRAY[NEW.queue], ARRAY[1::bigint]);
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION pgtask.capacity_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pgtask.capacity_releases (queue, released)
    SELECT q.name, 1 FROM pgtask.queues AS q
    WHERE q.name = OLD.queue AND q.max_outstanding_tasks IS NOT NULL;
    RETURN NULL;
END
$$;

DROP TRIGGER tasks_idempotency_state ON pgtask.tasks;
DROP FUNCTION pgtask.idempotency_state();

CREATE OR REPLACE FUNCTION pgtask.idempotency_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Until now the expiry was derived from the task; write it down before the task goes.
    -- Deleting history never releases a key early.
    UPDATE pgtask.idempotency_keys AS k
    SET expires_at = coalesce(k.expires_at, coalesce(OLD.completed_at, pgtask.now()) + make_interval(
        secs => coalesce(
            (SELECT q.idempotency_retention_seconds FROM pgtask.queues AS q WHERE q.name = OLD.queue),
            2592000)))
    WHERE k.queue = OLD.queue AND k.key = OLD.idempotency_key AND k.task_id = OLD.id;
    RETURN NULL;
END
$$;

-- The exact number of outstanding tasks of a queue whose limit is being turned on.
CREATE FUNCTION pgtask.recount_outstanding(p_queue text) RETURNS bigint
    LANGUAGE plpgsql AS $$
DECLARE
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        RAISE EXCEPTION 'turning on the capacity of queue % needs a READ COMMITTED transaction', p_queue
            USING ERRCODE = 'PT002',
                  HINT = 'The outstanding tasks are recounted; a snapshot older than the statement would miss some.';
    END IF;
    -- Unlimited enqueues do not count: wait for those in flight, hold new ones back until
    -- commit, and count with a fresh snapshot (each statement of this function takes one).
    -- Bounded: while this waits in the lock queue, every writer of pgtask.tasks waits too.
    BEGIN
        PERFORM set_config('lock_timeout', '3s', true);
        LOCK TABLE pgtask.tasks IN SHARE ROW EXCLUSIVE MODE;
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'turning on the capacity of queue % waited 3 s for transactions writing to pgtask.tasks', p_queue
            USING ERRCODE = '55P03',
                  HINT = 'A transaction that enqueued or changed tasks is still open; retry when it has ended.';
    END;
    DELETE FROM pgtask.capacity_releases WHERE queue = p_queue;
    RETURN (
        SELECT count(*) FROM pgtask.tasks
        WHERE queue = p_queue AND state IN ('pending', 'running', 'waiting'));
END
$$;

-- A limit changed on an existing queue (BEFORE UPDATE): recount when it is turned on.
CREATE FUNCTION pgtask.queue_capacity_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.max_outstanding_tasks IS NULL THEN
        IF OLD.max_outstanding_tasks IS NOT NULL THEN
            NEW.outstanding_tasks := 0;
            DELETE FROM pgtask.capacity_releases WHERE queue = NEW.name;
        END IF;
    ELSIF OLD.max_outstanding_tasks IS NULL THEN
        NEW.outstanding_tasks := pgtask.recount_outstanding(NEW.name);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER queues_capacity_changed
    BEFORE UPDATE OF max_outstanding_tasks ON pgtask.queues
    FOR EACH ROW EXECUTE FUNCTION pgtask.queue_capacity_changed();

-- A queue created with a limit (AFTER INSERT, which an upsert that conflicts never fires).
CREATE FUNCTION pgtask.queue_capacity_created() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pgtask.queues SET outstanding_tasks = pgtask.recount_outstanding(NEW.name)
    WHERE name = NEW.name;
    RETURN NULL;
END
$$;

CREATE TRIGGER queues_capacity_created
    AFTER INSERT ON pgtask.queues
    FOR EACH ROW
    WHEN (NEW.max_outstanding_tasks IS NOT NULL)
    EXECUTE FUNCTION pgtask.queue_capacity_created();

CREATE FUNCTION pgtask.queue_resumed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pgtask_ready', NEW.name);
    RETURN NULL;
END
$$;

CREATE TRIGGER queues_resumed
    AFTER UPDATE OF paused_at ON pgtask.queues
    FOR EACH ROW
    WHEN (OLD.paused_at IS NOT NULL AND NEW.paused_at IS NULL)
    EXECUTE FUNCTION pgtask.queue_resumed();
"""

# The 0001 bodies, restored on downgrade.
_DOWN = r"""
DROP TRIGGER queues_resumed ON pgtask.queues;
DROP FUNCTION pgtask.queue_resumed();
DROP TRIGGER queues_capacity_created ON pgtask.queues;
DROP FUNCTION pgtask.queue_capacity_created();
DROP TRIGGER queues_capacity_changed ON pgtask.queues;
DROP FUNCTION pgtask.queue_capacity_changed();
DROP FUNCTION pgtask.recount_outstanding(text);

CREATE OR REPLACE FUNCTION pgtask.admit_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    over record;
BEGIN
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

CREATE OR REPLACE FUNCTION pgtask.terminal_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    limited record;
BEGIN
    IF NEW.state IN ('succeeded', 'failed', 'cancelled') THEN
        PERFORM pg_notify('pgtask_result', NEW.id::text);
        UPDATE pgtask.queues
        SET outstanding_tasks = greatest(outstanding_tasks - 1, 0)
        WHERE name = NEW.queue AND max_outstanding_tasks IS NOT NULL;
    ELSE
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

CREATE OR REPLACE FUNCTION pgtask.capacity_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pgtask.queues
    SET outstanding_tasks = greatest(outstanding_tasks - 1, 0)
    WHERE name = OLD.queue AND max_outstanding_tasks IS NOT NULL;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION pgtask.idempotency_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pgtask.idempotency_keys AS k
    SET expires_at = coalesce(k.expires_at, statement_timestamp() + make_interval(secs => coalesce(
        (SELECT q.idempotency_retention_seconds FROM pgtask.queues AS q WHERE q.name = OLD.queue),
        2592000)))
    WHERE k.queue = OLD.queue AND k.key = OLD.idempotency_key AND k.task_id = OLD.id;
    RETURN NULL;
END
$$;

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

-- Derived expiries become explicit again, as 0001's trigger kept them.
UPDATE pgtask.idempotency_keys AS k
SET expires_at = t.completed_at + make_interval(secs => coalesce(q.idempotency_retention_seconds, 2592000))
FROM pgtask.tasks AS t LEFT JOIN pgtask.queues AS q ON q.name = t.queue
WHERE k.expires_at IS NULL AND t.id = k.task_id AND t.completed_at IS NOT NULL;

-- Fold the pending releases back into the counters 0001 keeps exact.
UPDATE pgtask.queues AS q
SET outstanding_tasks = greatest(q.outstanding_tasks - r.n, 0)
FROM (SELECT queue, sum(released) AS n FROM pgtask.capacity_releases GROUP BY queue) AS r
WHERE q.name = r.queue;

DROP FUNCTION pgtask.admit(text[], bigint[]);
"""


def upgrade() -> None:
    op.create_table(
        "capacity_releases",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("released", sa.Integer(), nullable=False),
        sa.CheckConstraint("released > 0", name=op.f("ck_capacity_releases_released")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_capacity_releases")),
        schema="pgtask",
    )
    op.create_index(
        "ix_capacity_releases_queue", "capacity_releases", ["queue"], schema="pgtask"
    )
    op.alter_column("tasks", "max_attempts", nullable=True, server_default=None, schema="pgtask")
    op.create_check_constraint(
        op.f("ck_tasks_max_attempts_known"), "tasks", "max_attempts IS NOT NULL OR attempt = 0",
        schema="pgtask",
    )
    # NULL for policies frozen before this revision: the next worker to register the identity
    # freezes its own max_attempts instead of being refused for a value nobody chose.
    op.add_column(
        "handler_policies", sa.Column("max_attempts", sa.Integer(), nullable=True), schema="pgtask"
    )
    op.create_check_constraint(
        op.f("ck_handler_policies_max_attempts"), "handler_policies",
        "max_attempts IS NULL OR max_attempts > 0",
        schema="pgtask",
    )
    op.create_index(
        "ix_tasks_finished", "tasks", ["queue", "state", "completed_at"], schema="pgtask",
        postgresql_where=sa.text(f"state IN {_TERMINAL}"),
    )
    op.execute(_UP)


def downgrade() -> None:
    op.execute(_DOWN)
    op.drop_index("ix_tasks_finished", table_name="tasks", schema="pgtask")
    op.drop_constraint(
        op.f("ck_handler_policies_max_attempts"), "handler_policies", schema="pgtask"
    )
    op.drop_column("handler_policies", "max_attempts", schema="pgtask")
    op.drop_constraint(op.f("ck_tasks_max_attempts_known"), "tasks", schema="pgtask")
    op.execute("UPDATE pgtask.tasks SET max_attempts = 5 WHERE max_attempts IS NULL")
    op.alter_column(
        "tasks", "max_attempts", nullable=False, server_default=sa.text("5"), schema="pgtask"
    )
    op.drop_table("capacity_releases", schema="pgtask")
    op.execute("DROP FUNCTION pgtask.now()")
