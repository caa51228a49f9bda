"""Alembic environment of the standalone migrator (``pgtask migrate``); not for user envs.

An application with its own Alembic environment does not use this file: it adds pgtask's
``versions`` folder to its own ``version_locations`` instead.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import func, select, text

from sqlalchemy_pgtask.migrations import (
    ADVISORY_LOCK_KEY,
    VERSION_TABLE,
    VERSION_TABLE_SCHEMA,
)

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    version_table=VERSION_TABLE,
    version_table_schema=VERSION_TABLE_SCHEMA,
    transaction_per_migration=False,
)
with context.begin_transaction():
    # The lock and the schema must exist before Alembic creates its version table there.
    connection.execute(select(func.pg_advisory_xact_lock(ADVISORY_LOCK_KEY)))
    connection.execute(text("CREATE SCHEMA IF NOT EXISTS pgtask"))
    context.run_migrations()
