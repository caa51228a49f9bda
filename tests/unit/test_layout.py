"""The package's layout rules, checked from its source: module size, layers, cycles, privacy.

No database. A module that outgrows one screen of concepts should become a package (frozen
migration revisions excepted); the import contracts in pyproject.toml hold (layers, no cycle
between siblings); no module is part of an import cycle; the worker and the command line
reach the rest of the library only through its seams (the worker never through the client:
a contract says so).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
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


GRAPH = grimp.build_graph(ROOT, cache_dir=None)


def imports_of(name: str) -> set[str]:
    """Modules of the package that ``name`` imports anywhere: at module level, in a function
    or under ``if TYPE_CHECKING:`` (each of them can close a cycle or break a layer)."""
    return set(GRAPH.find_modules_directly_imported_by(name))


def test_no_module_outgrows_one_screen_of_concepts() -> None:
    too_long = {
        name: lines
        for name, path in MODULES.items()
        if ".migrations.versions." not in name
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}


def test_the_import_contracts_in_pyproject_hold() -> None:
    # The layers, the acyclic packages and the worker's independence from the client, as
    # pyproject.toml declares them; CI runs the same command on its own as well.
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run(
        [lint, "--no-cache", "--config", str(PACKAGE.parent / "pyproject.toml")],
        cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_is_part_of_an_import_cycle() -> None:
    # The contracts compare siblings; this compares single modules, a package's __init__ with
    # its own submodules included (the root re-exports the API, so library code importing it
    # would be a cycle). Tarjan's strongly connected components, every import counted.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(imports_of(name)):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = [stack.pop()]
            while component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH.modules):
        if name not in index:
            visit(name)
    assert cycles == []


@pytest.mark.parametrize("package", ["sqlalchemy_pgtask.worker", "sqlalchemy_pgtask.cli"])
def test_the_worker_and_the_cli_use_no_private_module_of_the_client(package: str) -> None:
    def inside(module: str) -> bool:  # "sqlalchemy_pgtask.client" is not in ".cli"
        return module == package or module.startswith(f"{package}.")

    used = {target for name in GRAPH.modules if inside(name) for target in imports_of(name)}
    private = {
        t for t in used
        if not inside(t) and any(part.startswith("_") for part in t.split(".")[1:])
        # The seams meant for them: the connection, logging, waiting without losing a
        # cancellation, the validation of a task to add (a spawned child is checked
        # exactly like an enqueued task, through `enqueue.plan`), hot statements sent as
        # text compiled once (the worker's claim and outcome writes, like the client's
        # enqueue), which failures are retried after what backoff (the result waiters'
        # listener too), what a database URL is (libpq's multi-host form included), the
        # package's version and the defaults of a task.
        and t not in (
            f"{ROOT}._connection", f"{ROOT}._logging", f"{ROOT}._asyncio",
            f"{ROOT}._driver_sql", f"{ROOT}._failures", f"{ROOT}._url",
            f"{ROOT}._version", f"{ROOT}._defaults",
        )
    }
    assert private == set()
