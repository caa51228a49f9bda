"""Every public name and every path the documentation shows resolves. No database.

Moving a module (issue 25) must not break a user's import: the names each public module
exports in ``__all__``, the dotted ``sqlalchemy_pgtask...`` paths README.md, docs/,
examples/ and benchmarks/ mention (mkdocstrings ``::: path`` lines included), and the
``from sqlalchemy_pgtask... import ...`` statements of their Python code. A failure names
the module and the name, or the file that shows the path.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import sqlalchemy_pgtask

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "sqlalchemy_pgtask"
#: Alembic runs these as scripts, with its context configured; they are not imported.
NOT_IMPORTED = (f"{PACKAGE}.migrations.env", f"{PACKAGE}.migrations.versions")
DOTTED = re.compile(rf"\b{PACKAGE}(?:\.[A-Za-z_]\w*)*")
FENCE = re.compile(r"^(\s*)(```|~~~)\s*(\w*)[^\n]*\n(.*?)^\1\2\s*$", re.M | re.S)
#: ``from sqlalchemy_pgtask.x import (a, b as c)`` in a block too broken for ``ast``.
FROM_IMPORT = re.compile(rf"^\s*from\s+({PACKAGE}(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)


def _is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split(".")[1:])


def _optional_extra_missing(error: ModuleNotFoundError) -> bool:
    """The import failed for a third-party package an uninstalled extra would provide."""
    missing = error.name or ""
    return missing != PACKAGE and not missing.startswith(f"{PACKAGE}.")


def public_modules() -> Iterator[str]:
    yield PACKAGE
    # walk_packages imports the packages it descends into; an extra's absence surfaces below.
    for found in pkgutil.walk_packages(
        sqlalchemy_pgtask.__path__, f"{PACKAGE}.", onerror=lambda _name: None
    ):
        name = found.name
        if _is_public(name) and not name.startswith(NOT_IMPORTED):
            yield name


def _import(name: str) -> ModuleType:
    """The module, or None (the test is skipped) when an optional extra is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if _optional_extra_missing(error):
            pytest.skip(f"{name} needs {error.name}, which is not installed")
        raise


def exported_names() -> Iterator[tuple[str, str]]:
    for name in public_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not _optional_extra_missing(error):
                raise
            # Still listed, so the test reports the skip and names the module.
            yield name, "*"
            continue
        for exported in getattr(module, "__all__", ()):
            yield name, exported


EXPORTED = sorted(set(exported_names()))


def test_the_walk_finds_the_public_packages() -> None:
    modules = {module for module, _name in EXPORTED}
    expected = {"worker", "testing", "models", "statements", "enqueue", "durable", "schedule"}
    assert {f"{PACKAGE}.{name}" for name in expected} <= modules
    assert len(EXPORTED) > 300


@pytest.mark.parametrize(("module_name", "name"), EXPORTED, ids=[f"{m}:{n}" for m, n in EXPORTED])
def test_every_name_in_all_resolves(module_name: str, name: str) -> None:
    module = _import(module_name)
    assert hasattr(module, name), f"{module_name}.__all__ lists {name!r}, which it lacks"


# The documentation -------------------------------------------------------------------


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("examples", "benchmarks"):
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md"})
    return found


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def documented_paths() -> list[tuple[str, str]]:
    """Every dotted ``sqlalchemy_pgtask...`` path, with the first file that mentions it."""
    first: dict[str, str] = {}
    for path in documents():
        for match in DOTTED.finditer(path.read_text()):
            first.setdefault(match.group(0), _where(path))
    return sorted(first.items())


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            target: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name or module_name.startswith(f"{error.name}."):
                continue  # this prefix is not a module: try a shorter one
            if _optional_extra_missing(error):
                pytest.skip(f"{module_name} needs {error.name}, which is not installed")
            raise
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise AssertionError(f"{dotted}: no prefix is importable")


PATHS = documented_paths()


def test_the_documentation_mentions_paths() -> None:
    assert len(PATHS) > 20
    assert (f"{PACKAGE}.enqueue.enqueue", "docs/reference.md") in PATHS


@pytest.mark.parametrize(("dotted", "where"), PATHS, ids=[p for p, _ in PATHS])
def test_every_documented_path_resolves(dotted: str, where: str) -> None:
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{where} mentions {dotted}, which does not resolve: {error!r}")


def _imports_of(tree: ast.AST) -> Iterator[tuple[str, str]]:
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module == PACKAGE or node.module.startswith(f"{PACKAGE}."):
            yield from ((node.module, alias.name) for alias in node.names)


def _imports_of_text(code: str) -> Iterator[tuple[str, str]]:
    """A block ``ast`` cannot parse (``...`` placeholders, a fragment): its import lines."""
    for match in FROM_IMPORT.finditer(code):
        names = match.group(2).strip().strip("()").replace("\\", " ")
        for alias in names.split(","):
            if alias.strip():
                yield match.group(1), alias.split(" as ")[0].strip()


def _python_blocks(text: str) -> Iterator[str]:
    for match in FENCE.finditer(text):
        if match.group(3).lower() in {"python", "py", "pycon", "python3"}:
            indent = len(match.group(1))
            yield "\n".join(line[indent:] for line in match.group(4).splitlines())


def documented_imports() -> list[tuple[str, str, str]]:
    found: dict[tuple[str, str], str] = {}
    for path in documents():
        text = path.read_text()
        codes = [text] if path.suffix == ".py" else list(_python_blocks(text))
        for code in codes:
            try:
                imports = list(_imports_of(ast.parse(code)))
            except SyntaxError:
                imports = list(_imports_of_text(code))
            for imported in imports:
                found.setdefault(imported, _where(path))
    return sorted((module, name, where) for (module, name), where in found.items())


IMPORTS = documented_imports()


def test_the_documentation_shows_imports() -> None:
    assert len(IMPORTS) > 20
    assert (PACKAGE, "Registry", "README.md") in IMPORTS


@pytest.mark.parametrize(
    ("module_name", "name", "where"), IMPORTS, ids=[f"{m}:{n}" for m, n, _ in IMPORTS]
)
def test_every_documented_import_works(module_name: str, name: str, where: str) -> None:
    statement = f"from {module_name} import {name}"
    try:
        module = _import(module_name)
        if name != "*" and not hasattr(module, name):
            # `from package import submodule` works without the package exporting it.
            importlib.import_module(f"{module_name}.{name}")
    except ImportError as error:
        pytest.fail(f"{where} shows `{statement}`, which fails: {error!r}")
