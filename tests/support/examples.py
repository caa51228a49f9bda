"""examples: the programs under ``examples/``, imported as their documented commands name them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

from tests.support.workerproc import cli_env

__all__ = ["EXAMPLES", "load_example", "run_example_script"]

EXAMPLES: Final = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/NAME.py``, imported as module ``NAME`` (the name its worker command uses)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: pydantic resolves the models' annotations through it.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_example_script(name: str, database_url: str, cwd: Path) -> str:
    """Run ``python examples/NAME`` on ``database_url`` as its docstring says; its output, once
    it exited 0 and printed "example finished" last."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env=cli_env({"PGTASK_DATABASE_URL": database_url}),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("example finished"), result.stdout
    return result.stdout
