"""alembic_env: wires pgtask's branch into an application's own Alembic environment; never migrates.

It serves the application's Alembic environment, not the standalone migrator (that is
`sqlalchemy_pgtask.migrations`):

* `init_alembic_env` creates a new environment from the ``pgtask`` template (what ``pgtask
  init-alembic DIR`` runs). ``alembic init -t pgtask`` cannot do it, since Alembic looks for
  templates only in its own package.
* `include_name` and `process_revision_directives` are the two hooks that template's ``env.py``
  passes to ``context.configure``. An application with an existing ``env.py`` imports them
  from here (see ``docs/alembic.md``).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.operations.ops import MigrationScript
from alembic.runtime.environment import NameFilterParentNames, NameFilterType
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError, coerce_resource_to_filename

from sqlalchemy_pgtask.errors import PgTaskError
from sqlalchemy_pgtask.migrations import VERSION_TABLE
from sqlalchemy_pgtask.models import SCHEMA, metadata

__all__ = ["TEMPLATE", "include_name", "init_alembic_env", "process_revision_directives"]

#: The template's folder name under the templates directory.
TEMPLATE: Final = "pgtask"


def _template_directory() -> Path:
    """The folder that holds the ``pgtask`` template, in a wheel or in a source checkout."""
    module_dir = Path(__file__).resolve().parent
    candidates = (
        module_dir / "alembic_templates",  # a wheel force-includes it inside the package
        module_dir.parent / "alembic_templates",  # a source checkout or an editable install
    )
    for candidate in candidates:
        if (candidate / TEMPLATE / "env.py").is_file():
            return candidate
    searched = ", ".join(str(candidate) for candidate in candidates)
    raise PgTaskError(
        f"the Alembic template {TEMPLATE!r} is missing from this installation (looked in"
        f" {searched}); reinstall sqlalchemy-pgtask"
    )


class _TemplateConfig(Config):
    """An Alembic `Config` whose templates are pgtask's rather than Alembic's own."""

    def get_template_directory(self) -> str:
        return str(_template_directory())


def init_alembic_env(
    directory: str | os.PathLike[str],
    *,
    config_path: str | os.PathLike[str] | None = None,
) -> None:
    """Create an Alembic environment in ``directory`` that also applies pgtask's branch.

    Writes ``env.py``, ``script.py.mako``, ``README`` and an empty ``versions/`` folder into
    ``directory``, and an ``alembic.ini`` at ``config_path`` (default: ``alembic.ini`` in the
    current directory) whose ``version_locations`` list both the new ``versions/`` folder and
    ``sqlalchemy_pgtask:migrations/versions``. When ``directory`` is under the current
    directory, ``script_location`` is written relative to the ini file (``%(here)s/...``) so
    the project can move; otherwise it is written as an absolute path.

    Raises `PgTaskError` when ``directory`` exists and is not empty, when the ini file already
    exists (add pgtask to it by hand instead, as ``docs/alembic.md`` shows), or when the
    template is missing from the installation. Nothing is written in those cases.
    """
    target = Path(directory)
    ini = Path(config_path) if config_path is not None else Path("alembic.ini")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise PgTaskError(f"{target} already exists and is not an empty directory")
    if ini.exists():
        raise PgTaskError(
            f"{ini} already exists; add pgtask to that environment by hand (docs/alembic.md)"
        )
    _template_directory()  # fail before creating anything
    # Alembic writes a relative directory as "%(here)s/<path from the ini>" and an absolute
    # one verbatim. Hand it a relative path when the directory is under the working
    # directory (the usual case), so the project stays movable; its arithmetic is lexical,
    # so never a path with "..".
    absolute = Path(os.path.abspath(target))
    try:
        location = absolute.relative_to(Path.cwd())
    except ValueError:
        location = absolute
    try:
        command.init(_TemplateConfig(str(ini)), str(location), template=TEMPLATE)
    except CommandError as exc:
        raise PgTaskError(f"cannot create the Alembic environment: {exc}") from exc


def include_name(
    name: str | None, type_: NameFilterType, parent_names: NameFilterParentNames
) -> bool:
    """Alembic ``include_name`` hook: reflect the default schema and pgtask's own tables only.

    With ``include_schemas=True`` autogenerate would otherwise compare every schema in the
    database. This hook keeps it to the connection's default schema (which Alembic names
    ``None``) and ``pgtask``; inside ``pgtask`` it reflects only the tables that
    `sqlalchemy_pgtask.metadata` declares. Anything else there (the standalone migrator's
    ``pgtask.alembic_version``, or a table added by a newer pgtask revision) is never
    reflected, so autogenerate never proposes to drop it. Names of other kinds (columns,
    indexes, constraints) are all kept, so real drift in pgtask's tables still shows.
    The argument types are Alembic's own (``alembic.runtime.environment``), so the hook
    type-checks as ``context.configure(include_name=...)``.

    An application whose own tables live in other schemas wraps this hook::

        def include_name(name, type_, parent_names):
            if type_ == "schema" and name == "billing":
                return True
            return sqlalchemy_pgtask.alembic_env.include_name(name, type_, parent_names)
    """
    if type_ == "schema":
        return name is None or name == SCHEMA
    if type_ == "table" and parent_names.get("schema_name") == SCHEMA:
        return name != VERSION_TABLE and f"{SCHEMA}.{name}" in metadata.tables
    return True


def _pgtask_versions() -> Path:
    return Path(str(files("sqlalchemy_pgtask.migrations") / "versions")).resolve()


def _own_version_locations(script_directory: ScriptDirectory, pgtask_versions: Path) -> list[str]:
    return [
        location
        for location in script_directory.version_locations
        if coerce_resource_to_filename(location).resolve() != pgtask_versions
    ]


def process_revision_directives(
    context: MigrationContext, revision: object, directives: list[MigrationScript]
) -> None:
    """Alembic ``process_revision_directives`` hook: application revisions stay off pgtask's branch.

    In an environment whose only head is pgtask's (the application has no revision yet),
    ``alembic revision`` would take pgtask's head as the new revision's parent and, with
    several ``version_locations``, write the file next to it: inside the installed
    ``sqlalchemy_pgtask`` package, where the next install deletes it. This hook makes such a
    revision the root of the application's own branch instead (as ``--head base`` would) and
    writes it into the application's own versions folder. A revision that explicitly names a
    pgtask revision as its parent (``--head pgtask@head``) is refused: a revision that needs
    pgtask's tables declares ``--depends-on`` instead.

    Alembic calls it for ``alembic revision --autogenerate`` and ``alembic check``, and for a
    plain ``alembic revision`` only with ``revision_environment = true`` in alembic.ini (the
    template sets it).
    """
    script_directory = context.script
    if script_directory is None:
        return
    pgtask_versions = _pgtask_versions()
    for directive in directives:
        head = directive.head or "head"
        try:
            parents = script_directory.get_revisions(head)
        except CommandError:
            continue  # several heads, an unknown revision: Alembic reports those itself
        pgtask_parents = [
            parent.revision
            for parent in parents
            if Path(parent.path).resolve().parent == pgtask_versions
        ]
        if not pgtask_parents:
            continue
        if head != "head":
            raise CommandError(
                f"a new revision cannot descend from pgtask's revision {pgtask_parents[0]}:"
                " pgtask's branch belongs to the sqlalchemy_pgtask package. Base it on your"
                " own branch (--head base for the first one) and add --depends-on"
                f" {pgtask_parents[0]} if it needs pgtask's tables"
            )
        if directive.version_path is None:
            own = _own_version_locations(script_directory, pgtask_versions)
            if len(own) != 1:
                raise CommandError(
                    "this is the application's first revision: pass --head base and"
                    " --version-path with the folder it belongs in"
                )
            directive.version_path = own[0]
        directive.head = "base"
