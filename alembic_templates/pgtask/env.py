"""Alembic environment of an application that also applies sqlalchemy-pgtask's revisions.

pgtask's revisions are their own branch ("pgtask"), read from the installed package through
``version_locations`` in alembic.ini; apply everything with ``alembic upgrade heads``.
Autogenerate compares your models and pgtask's (``sqlalchemy_pgtask.metadata``) with the
default schema and schema ``pgtask`` only, so it proposes nothing for pgtask's tables once
its revisions are applied.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from alembic.util import CommandError
from sqlalchemy import MetaData, engine_from_config, pool

import sqlalchemy_pgtask
from sqlalchemy_pgtask.alembic_env import include_name, process_revision_directives

# The Alembic Config object: access to the values of the .ini file in use.
config = context.config

# Interpret the config file for Python logging. Loggers that already exist stay enabled, so
# running Alembic from inside an application does not silence it; code that configures
# logging itself passes Config(..., attributes={"configure_logger": False}).
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

# TODO: replace this empty MetaData with your models' metadata, for autogenerate support:
#     from myapp.models import Base
#     app_metadata = Base.metadata
app_metadata = MetaData()

# Your tables and pgtask's: autogenerate must know pgtask's tables, or it would propose
# dropping them.
target_metadata = [app_metadata, sqlalchemy_pgtask.metadata]


def database_url() -> str:
    """The URL to migrate: DATABASE_URL when set, else sqlalchemy.url from alembic.ini."""
    url = os.environ.get("DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise CommandError("no database URL: set DATABASE_URL or sqlalchemy.url in alembic.ini")
    return url


def run_migrations_offline() -> None:
    """Run migrations in 'offline' mode: emit the SQL to the script output, no connection."""
    context.configure(
        url=database_url(),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        target_metadata=target_metadata,
        include_schemas=True,
        include_name=include_name,
        compare_type=True,
        process_revision_directives=process_revision_directives,
    )

    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run migrations in 'online' mode, on a connection of a new Engine."""
    section = config.get_section(config.config_ini_section, {})
    # Set here rather than with config.set_main_option, which would read "%" in a
    # URL-encoded password as configparser interpolation.
    section["sqlalchemy.url"] = database_url()
    connectable = engine_from_config(section, prefix="sqlalchemy.", poolclass=pool.NullPool)

    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # Compare schema "pgtask" as well as the default schema. include_name keeps it to
            # those two, and within "pgtask" to the tables pgtask declares (never
            # pgtask.alembic_version, the standalone migrator's own version table).
            include_schemas=True,
            include_name=include_name,
            compare_type=True,
            # Keeps new revisions off pgtask's branch and out of its package (see README).
            process_revision_directives=process_revision_directives,
        )

        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
