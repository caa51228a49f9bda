"""The package's layout rules, checked from its source: module size, import cycles, privacy.

No database. A module that outgrows one screen of concepts should become a package (frozen
migration revisions excepted); modules import each other in one direction only; the worker
and the command line reach the rest of the library only through its seams.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import sqlalchemy_pgtask

PACKAGE = Path(sqlalchemy_pgtask.__file__).parent
ROOT = "sqlalchemy_pgtask"
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = modules()


def top_level_imports(name: str, path: Path) -> Iterator[str]:
    """Modules of the package that ``name`` imports when it is imported (not lazily)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import submodule` imports the submodule.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        yield from (t for t in targets if t == ROOT or t.startswith(f"{ROOT}."))


def test_no_module_outgrows_one_screen_of_concepts() -> None:
    too_long = {
        name: lines
        for name, path in MODULES.items()
        if ".migrations.versions." not in name
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}


def test_modules_import_each_other_in_one_direction_only() -> None:
    # The root package re-exports the public API, so a module it imports that imported it
    # back would be a cycle too: consumers such as the CLI may use it, library code may not.
    graph = {name: set(top_level_imports(name, path)) - {name} for name, path in MODULES.items()}

    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                cycles.append([*trail[trail.index(target):], target])
            elif target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("package", ["sqlalchemy_pgtask.worker", "sqlalchemy_pgtask.cli"])
def test_the_worker_and_the_cli_use_no_private_module_of_the_client(package: str) -> None:
    def inside(module: str) -> bool:  # "sqlalchemy_pgtask.client" is not in ".cli"
        return module == package or module.startswith(f"{package}.")

    used = {
        target
        for name, path in MODULES.items()
        if inside(name)
        for target in top_level_imports(name, path)
    }
    assert f"{ROOT}.client" not in used
    private = {
        t for t in used
        if not inside(t) and any(part.startswith("_") for part in t.split(".")[1:])
        # The seams meant for them: the connection, logging, waiting without losing a
        # cancellation, the validation of a task to add (a spawned child is checked
        # exactly like an enqueued task, through `enqueue.plan`), hot statements sent as text compiled once
        # (the worker's claim and outcome writes, like the client's enqueue), and which
        # failures are retried after what backoff (the result waiters' listener too), and
        # what a database URL is (libpq's multi-host form included), the package's version
        # and the defaults of a task.
        and t not in (
            f"{ROOT}._connection", f"{ROOT}._logging", f"{ROOT}._asyncio",
            f"{ROOT}._driver_sql", f"{ROOT}._failures", f"{ROOT}._url",
            f"{ROOT}._version", f"{ROOT}._defaults",
        )
    }
    assert private == set()
