"""``pgtask migrate`` reports the revision the schema is at, as the database records it.

It only ever upgrades: asked for a revision older than the one applied, it changes nothing,
and must not claim the schema is at the older one.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from sqlalchemy_pgtask.cli import main
from sqlalchemy_pgtask.migrations import current_revision, head_revision, upgrade


def _migrate(capsys: pytest.CaptureFixture[str], url: str, *revision: str) -> str:
    assert main(["migrate", "--database-url", url, *revision]) == 0
    return capsys.readouterr().out


def test_migrate_reports_the_revision_the_schema_is_at_never_an_older_target(
    pgtask_empty_database_url: str, empty_engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    url = pgtask_empty_database_url
    assert _migrate(capsys, url) == f"pgtask schema is at {head_revision()}\n"

    older = _migrate(capsys, url, "--revision", "pgtask_0004")

    with empty_engine.connect() as connection:
        assert current_revision(connection) == head_revision()  # nothing was downgraded
    assert f"pgtask schema is at {head_revision()}" in older
    assert "pgtask schema is at pgtask_0004" not in older


def test_migrate_upgrades_to_the_target_revision_and_reports_it(
    pgtask_empty_database_url: str, empty_engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    upgrade(pgtask_empty_database_url, "pgtask_0002")

    assert _migrate(capsys, pgtask_empty_database_url, "--revision", "pgtask_0004") == (
        "pgtask schema is at pgtask_0004\n"
    )
    with empty_engine.connect() as connection:
        assert current_revision(connection) == "pgtask_0004"
