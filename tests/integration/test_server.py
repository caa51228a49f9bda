"""provide_server and start_cluster against real PostgreSQL processes (no mocks)."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqlalchemy_pgtask.errors import InvalidOptionError, ServerNotFound
from sqlalchemy_pgtask.testing import ServerInfo, provide_server
from sqlalchemy_pgtask.testing._binaries import find_embedded
from sqlalchemy_pgtask.testing._cluster import _sweep_stale_dirs, start_cluster
from tests.support.waiting import wait_until

URL_ENV = "PGTASK_TEST_SERVER_URL"
BACKEND_ENV = "PGTASK_TEST_SERVER_BACKEND"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URL_ENV, raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("PG_BINDIR", raising=False)


@pytest.fixture
def no_docker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Docker unavailable even on a developer machine that has an engine."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")


def _pid_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        pass
    else:
        # A zombie is dead; it lingers only until its new parent reaps it.
        return stat.rsplit(")", 1)[1].split()[0] == "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_for_exit(pid: int, what: str, timeout: float = 30.0) -> None:
    wait_until(lambda: _pid_gone(pid), timeout, message=f"postgres {pid} to exit ({what})")


def _inspect(info: ServerInfo) -> tuple[str, Path, int]:
    """(version(), data directory, postmaster pid) of a running server."""
    engine = sa.create_engine(info.url)
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("select version()")).scalar_one()
            data = Path(conn.execute(sa.text("show data_directory")).scalar_one())
    finally:
        engine.dispose()
    pid = int((data / "postmaster.pid").read_text().splitlines()[0])
    return version, data, pid


def _create_database(url: str, name: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'create database "{name}"'))
        db_engine = sa.create_engine(sa.make_url(url).set(database=name))
        try:
            with db_engine.connect() as conn:
                assert conn.execute(sa.text("select current_database()")).scalar_one() == name
        finally:
            db_engine.dispose()
    finally:
        engine.dispose()


def test_embedded_starts_connectable_server_and_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "embedded")
    with provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV) as info:
        assert info.backend == "embedded"
        assert info.url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
        assert "PostgreSQL 18." in info.description
        version, data, pid = _inspect(info)
        assert "PostgreSQL 18." in version
        _create_database(info.url, "pgtask_server_check")
    _wait_for_exit(pid, "the context exited")
    assert not data.parent.exists()


def test_local_backend_and_cleanup_after_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "local")

    class Boom(Exception):
        pass

    def use_then_fail() -> tuple[Path, int]:
        with provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV) as info:
            assert info.backend == "local"
            version, data, pid = _inspect(info)
            # These machines ship Debian's PostgreSQL 15; elsewhere any local version will do.
            if "/usr/lib/postgresql/15/bin" in info.description:
                assert version.startswith("PostgreSQL 15.")
                assert "PostgreSQL 15." in info.description
            raise Boom(data, pid)

    with pytest.raises(Boom) as excinfo:
        use_then_fail()
    data, pid = excinfo.value.args
    _wait_for_exit(pid, "the server failed")
    assert not data.parent.exists()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            "postgresql://u:p%40ss@db.example:6543/app",
            "postgresql+psycopg://u:p%40ss@db.example:6543/app",
        ),
        ("postgres://u@db.example/app", "postgresql+psycopg://u@db.example/app"),
        ("postgresql+psycopg2://u@db.example/app", "postgresql+psycopg://u@db.example/app"),
        ("postgresql+psycopg://u@db.example/app", "postgresql+psycopg://u@db.example/app"),
    ],
)
def test_url_backend_normalises_to_psycopg(
    monkeypatch: pytest.MonkeyPatch, given: str, expected: str
) -> None:
    monkeypatch.setenv(URL_ENV, given)
    # No backend forced: the URL comes first and nothing is started or connected to.
    with provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV) as info:
        assert info == ServerInfo(url=expected, backend="url", description=info.description)
        assert URL_ENV in info.description
        assert "p%40ss" not in info.description


def test_url_backend_rejects_other_databases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URL_ENV, "sqlite:///x.db")
    with (
        pytest.raises(InvalidOptionError, match="not a PostgreSQL URL"),
        provide_server(url_env=URL_ENV),
    ):
        pass


def test_forced_url_without_url_is_server_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "url")
    with (
        pytest.raises(ServerNotFound, match=f"{URL_ENV} is not set"),
        provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV),
    ):
        pass


def test_forced_docker_without_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(BACKEND_ENV, "docker")
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    if Path("/var/run/docker.sock").exists():
        monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'missing.sock'}")
    with (
        pytest.raises(ServerNotFound) as excinfo,
        provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV),
    ):
        pass
    message = str(excinfo.value)
    assert "docker:" in message
    assert "no Docker engine" in message
    assert f"set {URL_ENV}" in message
    assert "embedded" not in message.split("Tried:")[1].split("To use")[0]


def test_docker_ping_failure_leaks_no_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A socket file that exists but has no listener: the docker client gets as far as connecting.
    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as fake:
        fake.bind(str(path))
        monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
        monkeypatch.setenv(BACKEND_ENV, "docker")
        with (
            pytest.raises(ServerNotFound, match="did not answer"),
            provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV),
        ):
            pass
        # Leaked sockets warn when collected; under filterwarnings=error that fails this test.
        gc.collect()


def test_docker_not_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "docker")
    with (
        pytest.raises(ServerNotFound, match=r"allow_docker=False"),
        provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV, allow_docker=False),
    ):
        pass


def test_bad_pg_bindir_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(BACKEND_ENV, "local")
    monkeypatch.setenv("PG_BINDIR", str(tmp_path))
    with (
        pytest.raises(ServerNotFound) as excinfo,
        provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV),
    ):
        pass
    message = str(excinfo.value)
    assert f"local: PG_BINDIR={tmp_path}" in message
    assert f"Only one backend was tried because {BACKEND_ENV} is set" in message


@pytest.mark.usefixtures("no_docker")
def test_auto_order_picks_embedded() -> None:
    with provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV) as info:
        assert info.backend == "embedded"
        assert "PostgreSQL 18." in _inspect(info)[0]


def test_unknown_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "kubernetes")
    with (
        pytest.raises(InvalidOptionError) as excinfo,
        provide_server(url_env=URL_ENV, backend_env=BACKEND_ENV),
    ):
        pass
    message = str(excinfo.value)
    assert BACKEND_ENV in message
    assert "'kubernetes'" in message
    assert "url, docker, embedded, local" in message
    assert isinstance(excinfo.value, ValueError)


@pytest.mark.slow
def test_server_dies_with_sigkilled_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, time
        import sqlalchemy as sa
        from sqlalchemy_pgtask.testing import provide_server

        with provide_server(url_env={URL_ENV!r}, backend_env={BACKEND_ENV!r}) as info:
            engine = sa.create_engine(info.url)
            with engine.connect() as conn:
                data = conn.execute(sa.text("show data_directory")).scalar_one()
            engine.dispose()
            with open(os.path.join(data, "postmaster.pid")) as f:
                pid = f.readline().strip()
            print(pid, data, flush=True)
            time.sleep(120)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in (URL_ENV, BACKEND_ENV)}
    env[BACKEND_ENV] = "embedded"
    with (tmp_path / "stderr").open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", "-c", script],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    data: Path | None = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"child failed: {(tmp_path / 'stderr').read_text()}"
        pid_text, data_text = line.split(maxsplit=1)
        pid, data = int(pid_text), Path(data_text.strip())
        assert not _pid_gone(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        _wait_for_exit(pid, "its parent was killed with SIGKILL")
        # Nothing of the child's could remove the temp dir; the next start sweeps it. That
        # may be another test's server starting in parallel (xdist) before this line: a
        # dir already gone was swept, by the same code.
        _sweep_stale_dirs(str(data.parent.parent))
        assert not data.parent.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        if data is not None:
            shutil.rmtree(data.parent, ignore_errors=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_install_unreachable_by_server_account_is_copied(tmp_path: Path) -> None:
    """As root the server runs as another account; a 0700 directory hides the install from it."""
    bindir, libs_dir = find_embedded()
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    site = bindir.parent.parent.parent
    root_copy = hidden / bindir.parent.relative_to(site)
    for sub in ("bin", "lib", "share"):
        shutil.copytree(bindir.parent / sub, root_copy / sub, symlinks=True)
    libs_copy = None
    if libs_dir is not None:
        libs_copy = hidden / libs_dir.relative_to(site)
        shutil.copytree(libs_dir, libs_copy, symlinks=True)

    with start_cluster(root_copy / "bin", libs_dir=libs_copy, backend="embedded") as info:
        version, data, _ = _inspect(info)
        assert "PostgreSQL 18." in version
        assert (data.parent / "install").is_dir()
    assert not data.parent.exists()
