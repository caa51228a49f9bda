"""An application's own Alembic environment from the ``pgtask`` template, with pgtask's branch.

Each test builds a sample application in ``tmp_path``: an environment from
`init_alembic_env`, a model of its own (``public.orders``) put where the template's TODO is,
and ``DATABASE_URL`` pointing at an empty database.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from alembic.script import Script
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import ProgrammingError

from sqlalchemy_pgtask.alembic_env import init_alembic_env
from sqlalchemy_pgtask.migrations import current_revision, head_revision, upgrade

_PLACEHOLDER = "app_metadata = MetaData()\n"
_ORDERS_MODEL = """\
from sqlalchemy import BigInteger, Column, Integer, Table, Text

app_metadata = MetaData()
Table(
    "orders",
    app_metadata,
    Column("id", Integer, primary_key=True),
    Column("total_cents", BigInteger, nullable=False),
    Column("note", Text),
)
"""
# The application's first revision, written by hand: the root of its own branch "app".
_ORDERS_REVISION = '''\
"""create orders"""

import sqlalchemy as sa
from alembic import op

revision = "app_0001"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("total_cents", sa.BigInteger(), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("orders")
'''


@dataclass(frozen=True)
class AppEnv:
    root: Path
    ini: Path
    versions: Path
    engine: Engine

    def config(self, output_buffer: io.StringIO | None = None) -> Config:
        # The test process keeps its own logging; the CLI test covers fileConfig.
        return Config(
            str(self.ini), output_buffer=output_buffer, attributes={"configure_logger": False}
        )

    def write_orders_revision(self) -> None:
        (self.versions / "app_0001_create_orders.py").write_text(_ORDERS_REVISION)

    def scalar(self, sql: str) -> object:
        with self.engine.connect() as connection:
            return connection.execute(text(sql)).scalar()

    def versions_recorded(self) -> set[str]:
        with self.engine.connect() as connection:
            rows = connection.execute(text("SELECT version_num FROM alembic_version"))
            return set(rows.scalars())


@pytest.fixture
def app_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pgtask_empty_database_url: str
) -> Iterator[AppEnv]:
    # The project's directory, as when a developer runs the commands there. Alembic prepends
    # prepend_sys_path (".") to sys.path on every command: undo that afterwards.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("DATABASE_URL", pgtask_empty_database_url)
    init_alembic_env(tmp_path / "migrations", config_path=tmp_path / "alembic.ini")
    env_py = tmp_path / "migrations" / "env.py"
    source = env_py.read_text()
    assert source.count(_PLACEHOLDER) == 1, "the template's metadata placeholder moved"
    env_py.write_text(source.replace(_PLACEHOLDER, _ORDERS_MODEL))
    engine = create_engine(pgtask_empty_database_url)
    try:
        yield AppEnv(
            root=tmp_path,
            ini=tmp_path / "alembic.ini",
            versions=tmp_path / "migrations" / "versions",
            engine=engine,
        )
    finally:
        engine.dispose()


def test_init_writes_an_environment_that_reads_both_version_locations(app_env: AppEnv) -> None:
    ini = app_env.ini.read_text()
    # Relative to the ini file, so the project can move.
    assert "\nscript_location = %(here)s/migrations\n" in ini
    assert "\n    %(here)s/migrations/versions\n    sqlalchemy_pgtask:migrations/versions\n" in ini
    config = app_env.config()

    assert config.get_main_option("script_location") == str(app_env.root / "migrations")
    locations = config.get_version_locations_list()
    assert locations == [str(app_env.versions), "sqlalchemy_pgtask:migrations/versions"]
    assert sorted(p.name for p in (app_env.root / "migrations").iterdir()) == [
        "README", "env.py", "script.py.mako", "versions",
    ]


def test_init_refuses_an_existing_alembic_ini(tmp_path: Path) -> None:
    from sqlalchemy_pgtask.errors import PgTaskError

    (tmp_path / "alembic.ini").write_text("[alembic]\n")

    with pytest.raises(PgTaskError, match="already exists"):
        init_alembic_env(tmp_path / "migrations", config_path=tmp_path / "alembic.ini")
    assert not (tmp_path / "migrations").exists()


def test_upgrade_heads_applies_both_branches_and_records_both_heads(app_env: AppEnv) -> None:
    app_env.write_orders_revision()

    command.upgrade(app_env.config(), "heads")

    assert app_env.scalar("SELECT to_regclass('public.orders')::text") == "orders"
    assert app_env.scalar("SELECT to_regclass('pgtask.tasks')::text") == "pgtask.tasks"
    assert app_env.versions_recorded() == {"app_0001", head_revision()}
    # The application's version table tracks pgtask; the standalone migrator's is not made.
    assert app_env.scalar("SELECT to_regclass('pgtask.alembic_version')") is None


def test_autogenerate_proposes_nothing_once_both_branches_are_applied(app_env: AppEnv) -> None:
    app_env.write_orders_revision()
    config = app_env.config()
    command.upgrade(config, "heads")

    command.check(config)  # raises AutogenerateDiffsDetected on any proposed operation

    script = command.revision(config, message="nothing", autogenerate=True, head="app@head")
    assert isinstance(script, Script)
    upgrade_body = Path(script.path).read_text().split("def upgrade()", 1)[1]
    assert "op." not in upgrade_body
    assert "pgtask" not in upgrade_body


def test_first_autogenerated_revision_creates_only_the_applications_tables(
    app_env: AppEnv,
) -> None:
    config = app_env.config()
    command.upgrade(config, "heads")  # only pgtask's branch so far

    script = command.revision(
        config, message="create orders", autogenerate=True, branch_label="app"
    )

    assert isinstance(script, Script)
    assert Path(script.path).parent == app_env.versions
    assert script.down_revision is None  # its own root, not a child of pgtask's head
    source = Path(script.path).read_text()
    assert "op.create_table('orders'" in source
    assert "pgtask" not in source

    command.upgrade(config, "heads")
    assert app_env.versions_recorded() == {script.revision, head_revision()}
    command.check(config)


def test_a_plain_first_revision_starts_the_applications_own_branch(app_env: AppEnv) -> None:
    config = app_env.config()

    script = command.revision(config, message="first")

    # Without the template's hook Alembic would base it on pgtask's head and write it into
    # the installed sqlalchemy_pgtask package.
    assert isinstance(script, Script)
    assert Path(script.path).parent == app_env.versions
    assert script.down_revision is None


def test_a_revision_cannot_descend_from_pgtasks_branch(app_env: AppEnv) -> None:
    app_env.write_orders_revision()

    with pytest.raises(CommandError, match="cannot descend from pgtask's revision"):
        command.revision(app_env.config(), message="bad", head="pgtask@head")
    assert sorted(p.name for p in app_env.versions.glob("*.py")) == [
        "app_0001_create_orders.py"
    ]


def test_downgrade_pgtask_to_base_removes_only_pgtasks_schema(app_env: AppEnv) -> None:
    app_env.write_orders_revision()
    config = app_env.config()
    command.upgrade(config, "heads")

    command.downgrade(config, "pgtask@base")

    assert app_env.scalar("SELECT to_regclass('public.orders')::text") == "orders"
    assert app_env.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'pgtask'") == 0
    assert app_env.versions_recorded() == {"app_0001"}


def test_offline_mode_emits_the_sql_of_both_branches(app_env: AppEnv) -> None:
    app_env.write_orders_revision()
    output = io.StringIO()

    command.upgrade(app_env.config(output_buffer=output), "heads", sql=True)

    sql = output.getvalue()
    assert "CREATE TABLE orders" in sql
    assert "CREATE TABLE pgtask.tasks" in sql
    assert "CREATE TRIGGER tasks_notify_inserted" in sql
    assert "INSERT INTO alembic_version (version_num) VALUES ('app_0001')" in sql
    # Nothing touched the database.
    assert app_env.scalar("SELECT to_regclass('public.alembic_version')") is None


def test_the_alembic_command_line_upgrades_heads_with_an_explicit_config(
    app_env: AppEnv,
) -> None:
    app_env.write_orders_revision()
    elsewhere = app_env.root / "elsewhere"
    elsewhere.mkdir()

    result = subprocess.run(
        [str(Path(sys.executable).parent / "alembic"), "-c", str(app_env.ini), "upgrade", "heads"],
        cwd=elsewhere,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert "Running upgrade  -> pgtask_0001" in result.stderr  # the ini's logging config
    assert app_env.versions_recorded() == {"app_0001", head_revision()}
    assert app_env.scalar("SELECT to_regclass('pgtask.tasks')::text") == "pgtask.tasks"


def test_applying_pgtask_from_both_migrators_fails_without_changing_anything(
    app_env: AppEnv, pgtask_empty_database_url: str
) -> None:
    app_env.write_orders_revision()
    upgrade(pgtask_empty_database_url)  # the standalone migrator, pgtask migrate

    with pytest.raises(ProgrammingError, match="already exists"):
        command.upgrade(app_env.config(), "heads")

    # One transaction: the application's own revision was rolled back with pgtask's.
    assert app_env.scalar("SELECT to_regclass('public.orders')") is None


def test_switching_from_the_standalone_migrator_is_a_stamp(
    app_env: AppEnv, pgtask_empty_database_url: str
) -> None:
    app_env.write_orders_revision()
    upgrade(pgtask_empty_database_url)
    config = app_env.config()
    command.upgrade(config, "app@head")
    with app_env.engine.connect() as connection:
        recorded = current_revision(connection)
    assert recorded == head_revision()

    command.stamp(config, recorded)
    with app_env.engine.begin() as connection:
        connection.execute(text("DROP TABLE pgtask.alembic_version"))

    assert app_env.versions_recorded() == {"app_0001", head_revision()}
    command.upgrade(config, "heads")  # nothing left to apply
    command.check(config)
