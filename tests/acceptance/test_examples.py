"""The runnable examples under ``examples/`` run as documented and do what they print."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy_pgtask.testing import ServerInfo
from tests.support.examples import run_example_script


def test_the_order_workflow_example_charges_once_and_ships(
    pgtask_server: ServerInfo, tmp_path: Path
) -> None:
    out = run_example_script("order_workflow.py", pgtask_server.url, tmp_path)
    assert "now waiting for approval (no worker slot held)" in out
    assert "workflow succeeded after 3 attempts (0 failed)" in out
    assert "order 1 is shipped, payment pay-1, tracking TRACK-000001" in out
    assert "external calls: {'charge': 1, 'label': 1}" in out
