"""workerproc: runs ``pgtask`` as real subprocesses against a test database; never mocks.

The acceptance tests treat the worker as a black box, the way an operator runs it:

* `write_tasks_app` writes ``tasks_app.py`` into a directory. Its handlers do what their payload
  says (sleep per attempt, record their run in ``acceptance_runs``, fail), so one module serves
  every test, and the worker imports it from its working directory as ``tasks_app:registry``.
* `WorkerLauncher` starts ``pgtask worker tasks_app:registry`` subprocesses with short leases,
  writes each one's output to a log file, waits (by polling ``pgtask.workers``, with a
  deadline) until the worker is registered and live, and kills whatever is left at teardown.
* `Database` is a test-side view of the same database through fresh connections (``NullPool``),
  so killing every backend of the database never breaks the test's own next query.

They wait with `tests.support.waiting.wait_until`: poll a condition until a deadline, never a
bare sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Row, create_engine, text
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import EnqueueRequest, enqueue_many
from tests.support.urls import libpq_url
from tests.support.waiting import wait_until

__all__ = [
    "LEASE_SECONDS",
    "LISTENER",
    "PGTASK",
    "POLL_SECONDS",
    "RUNS_TABLE",
    "TEST_APPLICATION",
    "Database",
    "WorkerLauncher",
    "WorkerProcess",
    "cli_env",
    "describe_all",
    "lines",
    "listener_pids",
    "run_cli",
    "terminate_backends",
    "write_tasks_app",
]

#: The console script installed next to this interpreter (the venv's ``pgtask``).
PGTASK: Path = Path(sys.executable).parent / "pgtask"

#: Where the ``job`` handler records its runs when the payload says ``"record": true``.
RUNS_TABLE = "acceptance_runs"

#: The ``application_name`` of the test's own connections, which fault injection spares.
TEST_APPLICATION = "pgtask-acceptance"

#: Defaults for every worker the tests start: short enough that expiry and recovery take
#: about a second, long enough that a loaded 2-core machine renews in time.
LEASE_SECONDS = 1.5
POLL_SECONDS = 1.0
STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0

_TASKS_APP = '''\
"""tasks_app: handlers for pgtask's acceptance tests; the payload decides what they do.

Payload keys (all optional):

* ``sleep``: seconds to sleep; ``sleep_by_attempt`` ({"1": 60}) overrides it per attempt.
* ``until``: the name of a file in the working directory: instead of sleeping, wait until it
  exists (the test decides when the handler ends: `WorkerLauncher.release`).
* ``record``: insert a row into acceptance_runs when the run starts and stamp its end, both
  with the database's clock_timestamp().
* ``fail``: raise after sleeping: ``"exit"`` raises SystemExit, ``"interrupt"``
  KeyboardInterrupt, anything else true a RuntimeError.
* ``stop_marker``: when the worker cancels the handler, write the time (``time.time()``) to
  ``stopped-<task id>-<attempt>`` in the working directory.
* ``terminate_on_return``: on attempt 1, just before returning, terminate every other client
  backend of the database except the test's own (so the worker's pool and listener die right
  before the outcome is written).

``job`` and ``job-sync`` read these; ``collector`` ignores its payload and returns the worker
process's cycle-collector settings.
"""

import asyncio
import gc
import os
import time
import uuid
from pathlib import Path

import psycopg

from sqlalchemy_pgtask import Registry, RetryPolicy

registry = Registry()
not_a_registry = {"job": "this is a dict, not a Registry"}

RECORD_URL = os.environ.get("ACCEPTANCE_RECORD_URL", "")
RETRY = RetryPolicy.fixed(0.2, jitter=False)
TEST_APPLICATION = "{test_application}"

_START = (
    "INSERT INTO acceptance_runs (task_id, attempt, run_id, worker_id, pid, started_at)"
    " VALUES (%s, %s, %s, %s, %s, clock_timestamp())"
)
_END = "UPDATE acceptance_runs SET finished_at = clock_timestamp() WHERE run_id = %s"
_TERMINATE = (
    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND backend_type = 'client backend' AND application_name <> %s"
)


def _seconds(ctx, payload):
    by_attempt = payload.get("sleep_by_attempt") or {}
    return float(by_attempt.get(str(ctx.attempt), payload.get("sleep", 0)))


async def _wait(ctx, payload):
    if payload.get("until"):
        while not Path(payload["until"]).exists():
            await asyncio.sleep(0.02)
    else:
        await asyncio.sleep(_seconds(ctx, payload))


def _wait_sync(ctx, payload):
    if payload.get("until"):
        while not Path(payload["until"]).exists():
            time.sleep(0.02)
    else:
        time.sleep(_seconds(ctx, payload))


def _fail(payload):
    fail = payload.get("fail")
    if fail == "exit":
        raise SystemExit(3)
    if fail == "interrupt":
        raise KeyboardInterrupt
    if fail:
        raise RuntimeError("the payload asked this attempt to fail")


async def _record(statement, params):
    conn = await psycopg.AsyncConnection.connect(RECORD_URL, autocommit=True)
    async with conn:
        await conn.execute(statement, params)


@registry.task("job", retry=RETRY)
async def job(ctx, payload):
    payload = payload or {}
    run_id = uuid.uuid4()
    if payload.get("record"):
        await _record(_START, (ctx.task_id, ctx.attempt, run_id, ctx.worker_id, os.getpid()))
    try:
        await _wait(ctx, payload)
    except asyncio.CancelledError:
        if payload.get("stop_marker"):
            # Where and when the worker stopped this handler (the database may be unreachable).
            Path(f"stopped-{ctx.task_id}-{ctx.attempt}").write_text(repr(time.time()))
        raise
    _fail(payload)
    if payload.get("record"):
        await _record(_END, (run_id,))
    if payload.get("terminate_on_return") and ctx.attempt == 1:
        await _record(_TERMINATE, (TEST_APPLICATION,))
    return {"run_id": str(run_id), "pid": os.getpid(), "attempt": ctx.attempt}


@registry.task("collector")
async def collector(ctx, payload):
    """The cycle collector's settings in the worker process, as the handler sees them."""
    return {"threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}


@registry.task("job-sync", retry=RETRY)
def job_sync(ctx, payload):
    """Blocks its thread and ignores stop requests: the worst case for a shutdown."""
    payload = payload or {}
    _wait_sync(ctx, payload)
    _fail(payload)
    return {"pid": os.getpid(), "attempt": ctx.attempt}
'''


def write_tasks_app(directory: Path) -> Path:
    """Write ``tasks_app.py`` into ``directory`` and return its path."""
    path = directory / "tasks_app.py"
    path.write_text(_TASKS_APP.replace("{test_application}", TEST_APPLICATION))
    return path


class Database:
    """Test-side SQL on one database; every call opens and closes its own connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = create_engine(
            url, poolclass=NullPool, connect_args={"application_name": TEST_APPLICATION}
        )

    def close(self) -> None:
        self.engine.dispose()

    def rows(self, sql: str, **params: Any) -> Sequence[Row[Any]]:
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).all()

    def row(self, sql: str, **params: Any) -> Row[Any] | None:
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).first()

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def execute(self, sql: str, **params: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(sql), params)

    def enqueue(
        self,
        name: str = "job",
        payload: Any = None,
        *,
        count: int = 1,
        replica: bool = False,
        **options: Any,
    ) -> list[uuid.UUID]:
        """Enqueue ``count`` identical tasks in one committed transaction; return their ids.

        ``replica`` sets ``session_replication_role = replica`` for that transaction, which
        disables the tasks' triggers, including the one that sends the NOTIFY hint.
        """
        requests = [EnqueueRequest(name=name, payload=payload, **options) for _ in range(count)]
        return self.enqueue_requests(requests, replica=replica)

    def enqueue_requests(
        self, requests: Iterable[EnqueueRequest], *, replica: bool = False
    ) -> list[uuid.UUID]:
        with self.engine.begin() as conn:
            if replica:
                conn.execute(text("SET LOCAL session_replication_role = replica"))
            return [result.id for result in enqueue_many(conn, list(requests))]

    def task(self, task_id: uuid.UUID) -> Row[Any]:
        row = self.row("SELECT * FROM pgtask.tasks WHERE id = :id", id=task_id)
        assert row is not None, f"task {task_id} does not exist"
        return row

    def attempts(self, task_id: uuid.UUID) -> Sequence[Row[Any]]:
        return self.rows(
            "SELECT * FROM pgtask.attempts WHERE task_id = :id ORDER BY attempt", id=task_id
        )

    def state(self, task_id: uuid.UUID) -> str:
        return str(self.task(task_id).state)

    def states(self, task_ids: Sequence[uuid.UUID]) -> dict[str, int]:
        rows = self.rows(
            "SELECT state, count(*) AS n FROM pgtask.tasks WHERE id = ANY(:ids) GROUP BY state",
            ids=list(task_ids),
        )
        return {r.state: r.n for r in rows}

    def all_in(self, task_ids: Sequence[uuid.UUID], *states: str) -> bool:
        counts = self.states(task_ids)
        return sum(counts.get(s, 0) for s in states) == len(task_ids)

    def create_runs_table(self) -> None:
        self.execute(
            f"""
            CREATE TABLE {RUNS_TABLE} (
                task_id uuid NOT NULL,
                attempt integer NOT NULL,
                run_id uuid NOT NULL UNIQUE,
                worker_id uuid NOT NULL,
                pid integer NOT NULL,
                started_at timestamptz NOT NULL,
                finished_at timestamptz,
                UNIQUE (task_id, attempt)
            )
            """
        )


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any pgtask URL, so only ``--database-url`` counts."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PGTASK_DATABASE_URL", "PGTASK_DEMO_BACKEND", "PGTASK_TEST_DATABASE_URL")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(
    *args: str,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``pgtask ARGS`` to completion and capture its output."""
    return subprocess.run(
        [str(PGTASK), *args],
        cwd=cwd,
        env=dict(env) if env is not None else cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass(eq=False)
class WorkerProcess:
    """One ``pgtask worker`` subprocess and its log."""

    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    started: float = field(default_factory=time.monotonic)
    #: The id it registered in pgtask.workers, once it is ready.
    worker_id: uuid.UUID | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        code = self.process.poll()
        status = "running" if code is None else f"exited with {code}"
        tail = "\n".join(self.log().splitlines()[-40:])
        return f"worker pid {self.pid} ({status}); log tail:\n{tail}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the worker did not exit within {timeout:.1f} s\n{self.describe()}"
            ) from None

    def stop(self) -> None:
        """Stop the process if it still runs (two SIGTERMs, then SIGKILL), reap it, close its log.

        A clean exit matters beyond tidiness: libfaketime removes its shared-memory files in
        /dev/shm only when the process exits normally.
        """
        if self.process.poll() is None:
            for _ in range(2):  # the second signal means "hand back and stop now"
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        if self.process.returncode == -signal.SIGKILL:
            for leftover in (f"faketime_shm_{self.pid}", f"sem.faketime_sem_{self.pid}"):
                Path("/dev/shm", leftover).unlink(missing_ok=True)
        if not self.log_file.closed:
            self.log_file.close()


class WorkerLauncher:
    """Starts worker subprocesses for one test and guarantees none outlives it.

    ``target`` is the ``module:registry`` every worker runs (``tasks_app:registry``, written
    by `write_tasks_app`, unless a test brings its own module).
    """

    def __init__(
        self, directory: Path, database: Database, target: str = "tasks_app:registry"
    ) -> None:
        self.directory = directory
        self.database = database
        self.target = target
        self.processes: list[WorkerProcess] = []

    def start(
        self,
        *options: str,
        lease: float = LEASE_SECONDS,
        poll: float = POLL_SECONDS,
        grace: float = 2.0,
        concurrency: int = 10,
        env: Mapping[str, str] | None = None,
        wait_ready: bool = True,
    ) -> WorkerProcess:
        """Start ``pgtask worker TARGET`` and (by default) wait until it is live."""
        index = len(self.processes)
        log_path = self.directory / f"worker-{index}.log"
        command = [
            str(PGTASK), "worker", self.target,
            "--database-url", self.database.url,
            "--lease-duration", str(lease),
            "--poll-interval", str(poll),
            "--shutdown-grace", str(grace),
            "--concurrency", str(concurrency),
            *options,
        ]
        log_file = log_path.open("wb")
        try:
            process = subprocess.Popen(
                command,
                cwd=self.directory,
                env=cli_env({"ACCEPTANCE_RECORD_URL": libpq_url(self.database.url), **(env or {})}),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        except BaseException:
            log_file.close()
            raise
        worker = WorkerProcess(process, log_path, log_file)
        self.processes.append(worker)
        if wait_ready:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: WorkerProcess, timeout: float = STARTUP_TIMEOUT) -> uuid.UUID:
        """Poll pgtask.workers until the process's row is live; fail early if it exits."""

        def registered() -> uuid.UUID | None:
            if not worker.alive():
                raise AssertionError(f"the worker exited during startup\n{worker.describe()}")
            found: uuid.UUID | None = self.database.scalar(
                "SELECT id FROM pgtask.workers"
                " WHERE pid = :pid AND expires_at > statement_timestamp() AND NOT draining",
                pid=worker.pid,
            )
            return found

        worker_id = wait_until(
            registered, timeout, message=f"worker pid {worker.pid} to register",
            describe=worker.describe,
        )
        assert worker_id is not None
        worker.worker_id = worker_id
        return worker_id

    def release(self, name: str) -> None:
        """End the handlers whose payload says ``"until": name``."""
        (self.directory / name).touch()

    def close(self) -> None:
        for worker in self.processes:
            worker.stop()


def lines(output: str) -> list[str]:
    """Non-empty lines of a command's output."""
    return [line for line in output.splitlines() if line.strip()]


def describe_all(workers: Iterable[WorkerProcess]) -> Callable[[], str]:
    """A ``describe`` callback for `wait_until` that shows every worker's log tail."""
    return lambda: "\n\n".join(w.describe() for w in workers)


#: Selects the worker's LISTEN connection in pg_stat_activity (its last query is the LISTEN).
LISTENER = "query = 'LISTEN pgtask_ready'"


def listener_pids(database: Database) -> set[int]:
    """Backend pids of the connections that LISTEN for pgtask's notifications."""
    rows = database.rows(
        f"SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND {LISTENER}"
    )
    return {int(r.pid) for r in rows}


def terminate_backends(database: Database, where: str = "true") -> int:
    """``pg_terminate_backend`` every client backend of the database matching ``where``,
    except the test's own connections; returns how many were terminated."""
    killed = database.scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend' AND application_name <> :test"
        f" AND ({where})",
        test=TEST_APPLICATION,
    )
    return int(killed or 0)
