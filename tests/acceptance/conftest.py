"""Fixtures for the acceptance tests: a test database, the tasks module, worker processes, and
``pgtask dashboard`` processes (`dashboards`, `DashboardProcess`, `free_port`)."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import httpx2
import pytest

from tests.support.waiting import wait_until
from tests.support.workerproc import PGTASK, Database, WorkerLauncher, cli_env, write_tasks_app

#: Where ``pgtask dashboard`` reads its admin token from when ``--admin-token`` is not given.
TOKEN_ENV: Final = "PGTASK_DASHBOARD_TOKEN"
STARTUP_TIMEOUT: Final = 30.0
STOP_TIMEOUT: Final = 15.0


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """A working directory holding ``tasks_app.py``, where worker processes start."""
    write_tasks_app(tmp_path)
    return tmp_path


@pytest.fixture
def db(pgtask_database_url: str) -> Iterator[Database]:
    """This test's migrated database, with the ``acceptance_runs`` table handlers record into."""
    database = Database(pgtask_database_url)
    try:
        database.create_runs_table()
        yield database
    finally:
        database.close()


@pytest.fixture
def workers(app_dir: Path, db: Database) -> Iterator[WorkerLauncher]:
    """Starts ``pgtask worker`` subprocesses; kills and reaps every one of them at teardown."""
    launcher = WorkerLauncher(app_dir, db)
    try:
        yield launcher
    finally:
        launcher.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(eq=False)
class DashboardProcess:
    """One ``pgtask dashboard`` subprocess and its log."""

    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    url: str

    #: Whether `stop` had to SIGKILL it (SIGTERM did not stop it in time).
    killed: bool = False

    def log(self) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        code = self.process.poll()
        status = "running" if code is None else f"exited with {code}"
        return f"pgtask dashboard pid {self.process.pid} ({status}); log:\n{self.log()}"

    def answers(self) -> bool:
        """Whether ``GET /login`` answers 200 (it does with ``--require-login`` too); fails at
        once if the process has exited."""
        assert self.process.poll() is None, self.describe()
        try:
            return httpx2.get(self.url + "/login", timeout=5.0).status_code == 200
        except httpx2.TransportError:
            return False

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """``signum``, wait; SIGKILL if it would not stop. The exit code (reaped either way)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.process.kill()
        code = self.process.wait()
        if not self.log_file.closed:
            self.log_file.close()
        return code


@pytest.fixture
def dashboards(tmp_path: Path) -> Iterator[Callable[..., DashboardProcess]]:
    """Start ``pgtask dashboard --database-url URL --host 127.0.0.1 --port <free> ARGS`` with
    ``env`` added to a clean environment, ``--log-level LOG_LEVEL`` and ``preexec_fn`` run in
    the child before it starts (a resource limit), once it answers; every one is stopped at
    teardown."""
    started: list[DashboardProcess] = []

    def start(
        database_url: str,
        *args: str,
        env: dict[str, str] | None = None,
        log_level: str = "info",
        preexec_fn: Callable[[], object] | None = None,
    ) -> DashboardProcess:
        port = free_port()
        environment = cli_env(env)
        if env is None or TOKEN_ENV not in env:
            environment.pop(TOKEN_ENV, None)
        log_path = tmp_path / f"dashboard-{len(started)}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(
            [str(PGTASK), "dashboard", "--database-url", database_url, "--host", "127.0.0.1",
             "--port", str(port), "--log-level", log_level, *args],
            cwd=tmp_path, env=environment, stdout=log_file, stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
        dashboard = DashboardProcess(process, log_path, log_file, f"http://127.0.0.1:{port}")
        started.append(dashboard)
        wait_until(dashboard.answers, STARTUP_TIMEOUT, interval=0.1,
                   message="the dashboard to answer GET /", describe=dashboard.describe)
        return dashboard

    try:
        yield start
    finally:
        for dashboard in started:
            dashboard.stop()
