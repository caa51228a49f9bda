"""docs/alembic.md, section 1, works as written on a fresh ``alembic init`` environment.

The test reads the guide's code blocks and applies them the way the guide says (add this block
below that line, change that line to this block) to the files a real ``alembic init migrations``
writes, with a minimal ``myapp/models.py`` for the guide's ``Base``. It then runs the
``alembic`` command line there: ``upgrade heads`` installs pgtask's schema and ``check`` finds
nothing to do. Editing the guide's blocks changes what this test applies.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from alembic.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask.migrations import head_revision

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "alembic.md"
ALEMBIC = Path(sys.executable).parent / "alembic"
#: The database URL the guide writes into alembic.ini; the test's own replaces it.
GUIDE_URL = "postgresql+psycopg://app@localhost/app"

_MODELS = '''\
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    pass
'''


@dataclass(frozen=True)
class Block:
    language: str
    text: str


def _section(markdown: str, heading: str) -> str:
    """The text under a heading, up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = markdown.splitlines()
    start = lines.index(heading) + 1
    end = next(
        (i for i in range(start, len(lines))
         if lines[i].startswith("#") and len(lines[i]) - len(lines[i].lstrip("#")) <= level),
        len(lines),
    )
    return "\n".join(lines[start:end])


def _subsection(markdown: str, prefix: str) -> str:
    [heading] = [line for line in markdown.splitlines() if line.startswith(prefix)]
    return _section(markdown, heading)


def _blocks(markdown: str) -> list[Block]:
    """Fenced code blocks, dedented by their fence's indentation (list items indent them)."""
    blocks: list[Block] = []
    fence: re.Match[str] | None = None
    body: list[str] = []
    for line in markdown.splitlines():
        if fence is None:
            fence = re.match(r"^( *)```(\w*)\s*$", line)
            body = []
        elif line.strip() == "```":
            indent = len(fence.group(1))
            blocks.append(Block(fence.group(2), "\n".join(b[indent:] for b in body) + "\n"))
            fence = None
        else:
            body.append(line)
    return blocks


def _guide_blocks(subsection: str, language: str) -> list[Block]:
    section = _section(GUIDE.read_text(), "## 1. An existing Alembic environment")
    return [b for b in _blocks(_subsection(section, subsection)) if b.language == language]


def _insert_below(source: str, anchor_line: str, block: str) -> str:
    lines = source.splitlines(keepends=True)
    [index] = [i for i, line in enumerate(lines) if line.rstrip("\n") == anchor_line]
    return "".join([*lines[: index + 1], block, *lines[index + 1:]])


def _replace_line(source: str, old_line: str, block: str) -> str:
    lines = source.splitlines(keepends=True)
    [index] = [i for i, line in enumerate(lines) if line.rstrip("\n") == old_line]
    return "".join([*lines[:index], block, *lines[index + 1:]])


def _alembic(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ALEMBIC), *args], cwd=project, env=os.environ.copy(), capture_output=True,
        text=True, timeout=120, check=False,
    )


@pytest.fixture
def fresh_project(tmp_path: Path) -> Path:
    """What ``alembic init migrations`` writes, plus the application's models."""
    result = _alembic(tmp_path, "init", "migrations")
    assert result.returncode == 0, result.stderr
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "models.py").write_text(_MODELS)
    return tmp_path


def _edit_alembic_ini(project: Path, database_url: str) -> None:
    ini = project / "alembic.ini"
    source = ini.read_text()
    add, *changes = _guide_blocks("### alembic.ini", "ini")
    # 1. Add below the commented-out example, inside the generated [alembic] section.
    source = _insert_below(
        source,
        "# version_locations = %(here)s/bar:%(here)s/bat:%(here)s/alembic/versions",
        add.text,
    )
    # The generated file must still parse: a repeated option is a DuplicateOptionError.
    configparser.ConfigParser().read_string(source)
    # 2. and 3. Change the generated lines these set.
    assert [c.text.split(" =", 1)[0] for c in changes] == ["path_separator", "sqlalchemy.url"]
    path_separator, url = changes
    source = _replace_line(source, "path_separator = os", path_separator.text)
    assert GUIDE_URL in url.text
    source = _replace_line(
        source, "sqlalchemy.url = driver://user:pass@localhost/dbname",
        url.text.replace(GUIDE_URL, database_url),
    )
    ini.write_text(source)


def _edit_env_py(project: Path) -> None:
    env_py = project / "migrations" / "env.py"
    source = env_py.read_text()
    imports, metadata, arguments, *_illustrations = _guide_blocks("### env.py", "python")
    # 1. Add the imports below the generated import of the context.
    source = _insert_below(source, "from alembic import context", imports.text)
    # 2. Change the metadata line.
    source = _replace_line(source, "target_metadata = None", metadata.text)

    # 3. Add the arguments after target_metadata=target_metadata in both configure calls.
    def add_arguments(match: re.Match[str]) -> str:
        indent = match.group(1)
        added = "\n".join(f"{indent}{line}" for line in arguments.text.splitlines())
        return f"{match.group(0).rstrip(',')},\n{added}"

    source, count = re.subn(
        r"(?m)^( +)(?:connection=connection, )?target_metadata=target_metadata,?$",
        add_arguments,
        source,
    )
    assert count == 2, "the generated env.py should call context.configure twice"
    env_py.write_text(source)


def test_the_guides_edits_make_a_fresh_alembic_init_apply_pgtasks_branch(
    fresh_project: Path, pgtask_empty_database_url: str
) -> None:
    _edit_alembic_ini(fresh_project, pgtask_empty_database_url)
    _edit_env_py(fresh_project)
    config = Config(str(fresh_project / "alembic.ini"))
    assert config.get_version_locations_list() == [
        str(fresh_project / "migrations" / "versions"),
        "sqlalchemy_pgtask:migrations/versions",
    ]

    upgraded = _alembic(fresh_project, "upgrade", "heads")
    assert upgraded.returncode == 0, upgraded.stderr
    assert "Running upgrade  -> pgtask_0001" in upgraded.stderr

    engine = create_engine(pgtask_empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            recorded = connection.execute(text("SELECT version_num FROM alembic_version"))
            assert set(recorded.scalars()) == {head_revision()}
            assert connection.execute(
                text("SELECT to_regclass('pgtask.tasks')::text")
            ).scalar() == "pgtask.tasks"
    finally:
        engine.dispose()

    # Autogenerate compares pgtask's schema (include_schemas, its metadata, include_name)
    # and finds nothing to do ...
    checked = _alembic(fresh_project, "check")
    assert checked.returncode == 0, checked.stderr
    assert "No new upgrade operations detected" in checked.stdout + checked.stderr
    # ... and would see a difference there: it does look at pgtask's tables.
    with engine.begin() as connection:
        connection.execute(text("DROP INDEX pgtask.ix_tasks_parent"))
    engine.dispose()
    drifted = _alembic(fresh_project, "check")
    assert drifted.returncode != 0
    assert "ix_tasks_parent" in drifted.stdout + drifted.stderr
