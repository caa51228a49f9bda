"""docs/testing.md's example runs as pasted: its files in an empty project, its command, one pass.

The guide's blocks are written as the files their first line names (``# app/tasks.py``,
``# tests/test_receipts.py``); a guide that shows no ``app/tasks.py`` gets a minimal one with
the ``registry`` and ``send_receipt`` its test imports, and a block of tests that names no file
becomes ``tests/test_from_the_guide.py``. The documented command then runs in a
subprocess against this session's server, and must report exactly one passed test: a skipped
or unrun ``async def`` test is a failure of the guide.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sqlalchemy_pgtask.testing import ServerInfo

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "testing.md"

_MINIMAL_TASKS = '''\
from sqlalchemy_pgtask import Registry

registry = Registry()


@registry.task("send-receipt")
async def send_receipt(ctx, payload):
    return f"receipt for order {payload['order_id']}"
'''


def _files_in_guide() -> dict[str, str]:
    """``{path: source}`` for every Python block whose first line is ``# <path>.py``, and for
    a block of tests that names no file."""
    files: dict[str, str] = {}
    for block in re.findall(r"^```python\n(.*?)^```$", GUIDE.read_text(), re.S | re.M):
        first = block.splitlines()[0]
        if re.fullmatch(r"# [\w/]+\.py", first):
            files[first[2:]] = block
        elif "def test_" in block:
            files["tests/test_from_the_guide.py"] = block
    return files


def test_the_testing_guides_example_passes_as_pasted(
    tmp_path: Path, pgtask_server: ServerInfo
) -> None:
    files = _files_in_guide()
    tests = [path for path, source in files.items() if "def test_" in source]
    assert len(tests) == 1, f"expected one test file in {GUIDE.name}, found {sorted(files)}"
    files.setdefault("app/tasks.py", _MINIMAL_TASKS)
    for path, source in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PGTASK_"))}
    env["PGTASK_TEST_DATABASE_URL"] = pgtask_server.url

    # The guide's command: python -m pytest <the test file>.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", tests[0]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
    )

    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = re.search(r"^=+ (.*) in [\d.]+s =+$", result.stdout, re.M)
    assert summary is not None, output
    # One test ran and passed: not skipped, not "no tests ran", not an unawaited coroutine.
    assert re.fullmatch(r"1 passed(, \d+ warnings?)?", summary.group(1)), output
