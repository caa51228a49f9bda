"""The shipped revisions and the models describe one schema (no drift).

Revisions applied to an empty database must produce exactly what ``metadata.create_all``
produces from the models, as PostgreSQL's own catalog reports it; Alembic's autogenerate must
see no difference either; and the triggers that only the revisions create must exist.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, text

from sqlalchemy_pgtask import metadata
from sqlalchemy_pgtask.alembic_env import include_name
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.testing import ServerInfo, create_database, drop_database
from tests.support.catalog import catalog_snapshot
from tests.support.engines import engine_for

_REVISIONS = (
    "pgtask_0001_initial", "pgtask_0002_runtime_v2", "pgtask_0003_durable",
    "pgtask_0004_operations", "pgtask_0005_fast_paths", "pgtask_0006_quiet_updates",
    "pgtask_0007_task_list", "pgtask_0008_written_checks", "pgtask_0009_attempts_unlocked",
    "pgtask_0010_snapshot_capacity", "pgtask_0011_signals_immutable", "pgtask_0012_inserted_checks",
    "pgtask_0013_one_walk_cascade", "pgtask_0014_least_privilege",
    "pgtask_0015_roles_closed", "pgtask_0016_concurrency_keys",
)


_TRIGGER_NAME = r"``((?:tasks|queues|signals|audit_log|checkpoints|idempotency_keys)_\w+)``"


def _documented_triggers() -> set[str]:
    """The triggers the revisions' docstrings promise (``tasks_...``/``queues_...`` names),
    minus those a later revision says it drops."""
    documented: set[str] = set()
    for name in _REVISIONS:
        revision = importlib.import_module(f"sqlalchemy_pgtask.migrations.versions.{name}")
        for line in (revision.__doc__ or "").split("\n* "):
            found = set(re.findall(_TRIGGER_NAME, line))
            if re.search(r"\bis dropped\b", line):
                documented -= found
            else:
                documented |= found
    return documented


@pytest.fixture
def migrated_url(pgtask_empty_database_url: str) -> str:
    """An empty database with the shipped revisions applied by the standalone migrator."""
    upgrade(pgtask_empty_database_url)
    return pgtask_empty_database_url


@pytest.fixture
def models_url(pgtask_server: ServerInfo) -> Iterator[str]:
    """A second empty database where the models are created with ``create_all``."""
    url = create_database(pgtask_server.url, "pgtask_models")
    try:
        with engine_for(url) as engine, engine.begin() as connection:
            connection.execute(text("CREATE SCHEMA pgtask"))
            metadata.create_all(connection)
        yield url
    finally:
        drop_database(url)


@pytest.fixture
def migrated_engine(migrated_url: str) -> Iterator[Engine]:
    with engine_for(migrated_url) as engine:
        yield engine


def test_revisions_on_an_empty_database_build_exactly_the_models_schema(
    migrated_url: str, models_url: str
) -> None:
    with engine_for(migrated_url) as migrated, engine_for(models_url) as models:
        from_revisions = catalog_snapshot(migrated)
        from_models = catalog_snapshot(models)

    # The comparison is only as good as the snapshot: it must see every kind of object.
    assert {line.split(" ", 1)[0] for line in from_models} == {
        "relation", "column", "constraint", "index",
    }
    assert "relation tasks: kind=r" in "\n".join(from_models)
    diff = "\n".join(
        difflib.unified_diff(
            from_models, from_revisions, "models (create_all)", "revisions (upgrade)",
            lineterm="",
        )
    )
    assert from_revisions == from_models, f"schema drift:\n{diff}"


def _compare(connection: Connection, *, with_include_name: bool) -> list[object]:
    context = MigrationContext.configure(
        connection,
        opts={
            "include_schemas": True,
            "compare_type": True,
            "compare_server_default": True,
            "include_name": include_name if with_include_name else None,
            "target_metadata": metadata,
        },
    )
    return list(compare_metadata(context, metadata))


def test_autogenerate_finds_no_difference_between_revisions_and_models(
    migrated_engine: Engine,
) -> None:
    with migrated_engine.connect() as connection:
        differences = _compare(connection, with_include_name=True)

    assert differences == []


def test_include_name_hides_the_standalone_migrators_version_table(
    migrated_engine: Engine,
) -> None:
    # The filter is what keeps pgtask.alembic_version out of autogenerate: without it,
    # Alembic would propose to drop that table (so the test above is not vacuous).
    with migrated_engine.connect() as connection:
        unfiltered = _compare(connection, with_include_name=False)
        filtered = _compare(connection, with_include_name=True)

    removed = [
        (diff[1].schema, diff[1].name)
        for diff in unfiltered
        if isinstance(diff, tuple) and diff[0] == "remove_table"
    ]
    assert ("pgtask", "alembic_version") in removed
    assert filtered == []


def test_revisions_create_the_documented_triggers_and_their_functions(
    migrated_engine: Engine,
) -> None:
    documented = _documented_triggers()
    with migrated_engine.connect() as connection:
        triggers = connection.execute(text("""
            SELECT t.tgname, c.relname, pn.nspname, p.proname, t.tgenabled::text
            FROM pg_trigger AS t
            JOIN pg_class AS c ON c.oid = t.tgrelid
            JOIN pg_namespace AS n ON n.oid = c.relnamespace
            JOIN pg_proc AS p ON p.oid = t.tgfoid
            JOIN pg_namespace AS pn ON pn.oid = p.pronamespace
            WHERE n.nspname = 'pgtask' AND NOT t.tgisinternal
        """)).all()
        trigger_functions = set(
            connection.execute(text("""
                SELECT p.proname FROM pg_proc AS p
                JOIN pg_namespace AS n ON n.oid = p.pronamespace
                WHERE n.nspname = 'pgtask' AND p.prorettype = 'trigger'::regtype
            """)).scalars()
        )

    assert len(documented) >= 5, f"could not read the trigger list from the docstring: {documented}"
    assert {name for name, *_ in triggers} == documented
    # Every trigger is enabled and runs a function of schema pgtask ...
    assert {(schema, enabled) for _, _, schema, _, enabled in triggers} == {("pgtask", "O")}
    # ... and every trigger function there is used by one of them (nothing left behind).
    assert trigger_functions == {function for *_, function, _ in triggers}
