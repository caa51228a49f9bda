"""The runnable examples under ``examples/`` run as documented and do what they print."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sqlalchemy_pgtask.testing import ServerInfo
from tests.support.workerproc import cli_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_order_workflow_example_charges_once_and_ships(
    pgtask_server: ServerInfo, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "order_workflow.py")],
        cwd=tmp_path,
        env=cli_env({"PGTASK_DATABASE_URL": pgtask_server.url}),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "now waiting for approval (no worker slot held)" in out
    assert "workflow succeeded after 3 attempts (0 failed)" in out
    assert "order 1 is shipped, payment pay-1, tracking TRACK-000001" in out
    assert "external calls: {'charge': 1, 'label': 1}" in out
    assert out.rstrip().endswith("example finished")
