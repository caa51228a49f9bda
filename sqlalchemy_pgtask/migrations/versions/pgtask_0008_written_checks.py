"""pgtask 0008: the checks on a task's names and JSON run only when those columns are written.

Revision ID: pgtask_0008
Revises: pgtask_0007
Create Date: 2026-12-02

PostgreSQL evaluates every CHECK constraint of a table on every ``UPDATE`` of a row, whatever
columns it sets. Six of ``pgtask.tasks``'s re-read what only an enqueue writes (or a completion,
once): the name and queue patterns, and the sizes of ``payload``, ``headers``, ``result`` and
``error``, each measured by printing the ``jsonb`` back as text (after decompressing it from
TOAST). A task is updated at least twice (claim, completion), and more with lease renewals and
retries: for payloads of ~10 KB those re-serialisations were a third of what draining cost
PostgreSQL.

The six constraints become row triggers with the same conditions, each fired only by an
``INSERT`` or by an ``UPDATE`` that sets its column; ``COPY`` runs them too. The conditions sit
in the triggers' ``WHEN`` clauses, evaluated like a CHECK's, so a valid row calls no function,
and a bad one raises ``check_violation`` (SQLSTATE 23514) naming the constraint it replaces,
as before:

* ``tasks_check_name``, ``tasks_check_queue``: the name patterns (``ck_tasks_name``,
  ``ck_tasks_queue``);
* ``tasks_check_payload_size``, ``tasks_check_headers``, ``tasks_check_result_size``,
  ``tasks_check_error_size``: the JSON sizes (and that headers are an object).

Unlike a CHECK, a trigger fires after the row is written and before the statement ends, so a
row that an ``ON CONFLICT DO NOTHING`` skips is not checked; the library validates every value
in Python before it sends it either way.

On a server built with lz4, ``payload`` and ``result`` are compressed with lz4 instead of pglz
(values written from now on; stored ones stay as they are): PostgreSQL copies 10 KB payloads
about 1.35 times as fast. A server without lz4 keeps pglz.
"""

from __future__ import annotations

from alembic import op

revision = "pgtask_0008"
down_revision = "pgtask_0007"
branch_labels = None
depends_on = None

#: (trigger, column, condition a valid row meets, constraint the error names).
_CHECKS = (
    ("tasks_check_name", "name",
     "NEW.name ~ '^[A-Za-z0-9._:-]+$' AND octet_length(NEW.name) <= 255", "ck_tasks_name"),
    ("tasks_check_queue", "queue",
     "NEW.queue ~ '^[A-Za-z0-9._:-]+$' AND octet_length(NEW.queue) <= 128", "ck_tasks_queue"),
    ("tasks_check_payload_size", "payload",
     "octet_length(NEW.payload::text) <= 1048576", "ck_tasks_payload_size"),
    ("tasks_check_headers", "headers",
     "jsonb_typeof(NEW.headers) = 'object' AND octet_length(NEW.headers::text) <= 65536",
     "ck_tasks_headers"),
    ("tasks_check_result_size", "result",
     "NEW.result IS NULL OR octet_length(NEW.result::text) <= 1048576", "ck_tasks_result_size"),
    ("tasks_check_error_size", "error",
     "NEW.error IS NULL OR octet_length(NEW.error::text) <= 262144", "ck_tasks_error_size"),
)

_FUNCTION = r"""
CREATE FUNCTION pgtask.check_failed() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pgtask, pg_temp AS $$
BEGIN
    -- The trigger's WHEN holds the condition: this runs only for a row that fails it.
    RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"', TG_TABLE_NAME, TG_ARGV[0]
        USING ERRCODE = 'check_violation', CONSTRAINT = TG_ARGV[0], SCHEMA = TG_TABLE_SCHEMA,
              TABLE = TG_TABLE_NAME, DETAIL = format('Failing row has id %s.', NEW.id);
END
$$;
"""

# A DO block, so offline mode (``--sql``) emits it too.
_LZ4 = r"""
DO $$
BEGIN
    ALTER TABLE pgtask.tasks
        ALTER COLUMN payload SET COMPRESSION lz4,
        ALTER COLUMN result SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    NULL;  -- built without lz4: pglz, as before
END
$$;
"""


def upgrade() -> None:
    op.execute(_FUNCTION)
    for trigger, column, condition, constraint in _CHECKS:
        op.execute(f"ALTER TABLE pgtask.tasks DROP CONSTRAINT {constraint}")
        op.execute(
            f"CREATE TRIGGER {trigger} AFTER INSERT OR UPDATE OF {column} ON pgtask.tasks"
            f" FOR EACH ROW WHEN (NOT ({condition}))"
            f" EXECUTE FUNCTION pgtask.check_failed('{constraint}')"
        )
    op.execute(_LZ4)


def downgrade() -> None:
    op.execute(
        "ALTER TABLE pgtask.tasks ALTER COLUMN payload SET COMPRESSION DEFAULT,"
        " ALTER COLUMN result SET COMPRESSION DEFAULT"
    )
    for trigger, _column, condition, constraint in reversed(_CHECKS):
        op.execute(f"DROP TRIGGER {trigger} ON pgtask.tasks")
        op.execute(
            f"ALTER TABLE pgtask.tasks ADD CONSTRAINT {constraint}"
            f" CHECK ({condition.replace('NEW.', '')})"
        )
    op.execute("DROP FUNCTION pgtask.check_failed()")
