"""migrations: installs and upgrades the pgtask schema with its shipped Alembic revisions.

The revisions live on the Alembic branch ``pgtask`` (root ``pgtask_0001``). There are two ways
to apply them:

* in your own Alembic environment, add ``sqlalchemy_pgtask:migrations/versions`` to
  ``version_locations`` and run ``alembic upgrade heads`` (see ``docs/alembic.md``);
* without one, call `upgrade` (or run ``pgtask migrate``): it records the applied revision in
  ``pgtask.alembic_version`` so it never collides with an application's own version table.

Revisions are frozen once released: a schema change is a new revision, never an edit. They
never import ``sqlalchemy_pgtask.models``; the drift test proves both describe one schema.
"""

from __future__ import annotations

import threading
from importlib.resources import files
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, text

from sqlalchemy_pgtask._url import database_url

__all__ = [
    "BRANCH",
    "HEAD",
    "VERSION_LOCATION",
    "VERSION_TABLE",
    "VERSION_TABLE_SCHEMA",
    "current_revision",
    "downgrade",
    "head_revision",
    "upgrade",
]

BRANCH: Final = "pgtask"
HEAD: Final = "pgtask@head"
#: The value to add to ``version_locations`` in an application's own ``alembic.ini``.
VERSION_LOCATION: Final = "sqlalchemy_pgtask:migrations/versions"
#: Where the standalone migrator (`upgrade`, ``pgtask migrate``) records what it applied.
VERSION_TABLE: Final = "alembic_version"
VERSION_TABLE_SCHEMA: Final = "pgtask"
#: Serialises concurrent standalone migrations (an arbitrary constant, unique to pgtask).
ADVISORY_LOCK_KEY: Final = 0x7067_7461_736B  # "pgtask"


def _script_location() -> Path:
    return Path(str(files("sqlalchemy_pgtask.migrations")))


def _config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(_script_location()))
    config.attributes["connection"] = connection
    return config


#: Alembic's command API runs through process-wide proxies (``alembic.context``,
#: ``alembic.op``): two migrations in one process must not interleave, whatever the database
#: lock says. Processes are serialised by the advisory lock in ``env.py``.
_PROCESS_LOCK: Final = threading.Lock()


def _run(bind: Engine | Connection | str, action: str, revision: str) -> None:
    with _PROCESS_LOCK:
        _run_locked(bind, action, revision)


def _run_locked(bind: Engine | Connection | str, action: str, revision: str) -> None:
    engine: Engine | None = None
    if isinstance(bind, str):
        engine = bind = create_engine(database_url(bind, "bind"))
    try:
        if isinstance(bind, Engine):
            with bind.connect() as connection:
                getattr(command, action)(_config(connection), revision)
                connection.commit()
        else:
            getattr(command, action)(_config(bind), revision)
    finally:
        if engine is not None:
            engine.dispose()


def upgrade(bind: Engine | Connection | str, revision: str = HEAD) -> None:
    """Apply pgtask's revisions up to ``revision`` (default: the branch head).

    Given a `Connection`, the work joins its transaction and the caller commits; given an
    `Engine` or a URL, it commits itself. Safe to run from several processes at once.
    """
    _run(bind, "upgrade", revision)


def downgrade(bind: Engine | Connection | str, revision: str) -> None:
    """Revert pgtask's revisions down to ``revision`` (``"pgtask@base"`` removes everything)."""
    _run(bind, "downgrade", revision)


def head_revision() -> str:
    """The newest revision this version of the library ships."""
    config = Config()
    config.set_main_option("script_location", str(_script_location()))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


def current_revision(connection: Connection) -> str | None:
    """The pgtask revision applied by the standalone migrator, or None if none is recorded.

    Looks in ``pgtask.alembic_version`` only; an application that applies the branch from its
    own Alembic environment tracks it in its own version table.
    """
    exists = connection.execute(
        text("SELECT to_regclass('pgtask.alembic_version') IS NOT NULL")
    ).scalar_one()
    if not exists:
        return None
    context = MigrationContext.configure(
        connection,
        opts={"version_table": VERSION_TABLE, "version_table_schema": VERSION_TABLE_SCHEMA},
    )
    heads = context.get_current_heads()
    return heads[0] if heads else None
