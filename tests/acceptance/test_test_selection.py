"""The inner loop's selection, ``pytest -n auto -m "not processes and not slow"`` (README,
"Tests: the full suite and the inner loop"), is what it says: unit and integration tests,
none that starts a process of its own and none listed as slow, and not empty; the full suite
has them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import PROCESS_MODULES, SLOW_MODULES, SLOW_TESTS

ROOT = Path(__file__).resolve().parents[2]
INNER_LOOP = "not processes and not slow"


def collected(*options: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *options],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_inner_loop_runs_unit_and_integration_tests_and_no_process_or_slow_test() -> None:
    everything = collected()
    inner = collected("-m", INNER_LOOP)

    assert inner
    assert set(inner) < set(everything)
    files = {node.split("::")[0] for node in inner}
    assert any(f.startswith("tests/unit/") for f in files)
    assert any(f.startswith("tests/integration/") for f in files)
    process_places = (
        "tests/acceptance/", "tests/migrations/", *(f"tests/{m}" for m in PROCESS_MODULES)
    )
    slow_places = tuple(f"tests/{m}" for m in SLOW_MODULES)
    slow_functions = {f"tests/{t}" for t in SLOW_TESTS}
    for node in inner:
        assert not node.startswith(process_places), node
        assert "test_browser" not in node, node  # every browser test uses Chromium
        assert not node.startswith(slow_places), node
        assert node.split("[")[0] not in slow_functions, node
    # Every listed slow test exists (a renamed test would silently join the inner loop).
    functions = {node.split("[")[0] for node in everything}
    assert slow_functions <= functions, slow_functions - functions
    for place in (*process_places, *slow_places):
        assert any(node.startswith(place) for node in everything), place
