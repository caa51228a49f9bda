"""pgbouncer: Debian's PgBouncer in transaction mode in front of the test server; never mocks.

`transaction_pooler` writes its own ini into a temporary directory (trust authentication,
``pool_mode = transaction``, every database forwarded to the test server), starts
``pgbouncer`` in the foreground on a free port (as the ``postgres`` account when run as root:
PgBouncer refuses root), waits until it accepts connections, and stops it on exit. It never
uses the service the Debian package may have started on 6432.

Tests skip when ``pgbouncer`` is not installed, unless ``PGTASK_REQUIRE_PGBOUNCER=1`` (CI),
in which case they fail.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import make_url

__all__ = ["require_pgbouncer", "transaction_pooler"]

_READY_TIMEOUT = 15.0


def require_pgbouncer() -> str:
    """The ``pgbouncer`` executable; skip (or fail, under PGTASK_REQUIRE_PGBOUNCER=1) if none."""
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if found is None:
        message = "pgbouncer is not installed (apt-get install pgbouncer)"
        if os.environ.get("PGTASK_REQUIRE_PGBOUNCER") == "1":
            pytest.fail(f"{message}, and PGTASK_REQUIRE_PGBOUNCER=1")
        pytest.skip(message)
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def transaction_pooler(
    database_url: str, *, pool_size: int = 20, mode: str = "transaction"
) -> Iterator[str]:
    """Yield ``database_url`` rewritten to go through PgBouncer (``pool_mode = mode``)."""
    executable = require_pgbouncer()
    url = make_url(database_url)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pgtask-pgbouncer-") as tmp:
        directory = Path(tmp)
        user = url.username or "postgres"
        (directory / "userlist.txt").write_text(f'"{user}" ""\n')
        (directory / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={url.host or '127.0.0.1'} port={url.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {directory / 'userlist.txt'}\n"
            f"pool_mode = {mode}\n"
            f"default_pool_size = {pool_size}\nmax_client_conn = 2000\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {directory / 'pgbouncer.log'}\n"
        )
        run_as = None
        if os.geteuid() == 0:
            run_as = pwd.getpwnam("postgres")
            for path in (directory, *directory.iterdir()):
                os.chown(path, run_as.pw_uid, run_as.pw_gid)
        process = subprocess.Popen(
            [executable, str(directory / "pgbouncer.ini")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            user=run_as.pw_uid if run_as else None,
            group=run_as.pw_gid if run_as else None,
            extra_groups=[] if run_as else None,
        )
        try:
            deadline = time.monotonic() + _READY_TIMEOUT
            while True:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    log = (directory / "pgbouncer.log")
                    tail = log.read_text() if log.exists() else ""
                    raise AssertionError(f"pgbouncer did not start on {port}:\n{tail}")
                time.sleep(0.02)
            yield url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
