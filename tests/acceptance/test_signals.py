"""``pgtask worker`` and the signals of its lifetime (issue 6, B4 and B7).

A second SIGTERM or SIGINT may arrive at any moment of a shutdown, including while the event
loop closes and the interpreter exits: the worker still exits 0. An internal failure no retry
can fix stops the worker with a non-zero exit instead of leaving a zombie that renews leases.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from sqlalchemy_pgtask.worker import COLLECTOR_THRESHOLD
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, WorkerLauncher

#: Gaps between the first and the second signal; the shutdown of an idle worker takes about as
#: long, so some of them land while the loop closes or the interpreter exits.
GAPS = (0.0, 0.01, 0.03, 0.06, 0.12)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_during_shutdown_still_exits_zero(
    workers: WorkerLauncher, signum: signal.Signals
) -> None:
    for gap in GAPS:
        worker = workers.start()
        worker.send(signum)
        time.sleep(gap)  # the fault: when the second signal lands
        worker.send(signum)
        code = worker.wait_exit(30)
        assert code == 0, f"exit {code} with a second {signum.name} {gap}s later\n" + (
            worker.describe()
        )


def test_a_third_signal_is_ignored_while_the_worker_stops(workers: WorkerLauncher) -> None:
    worker = workers.start()
    for _ in range(3):
        worker.send(signal.SIGTERM)
    assert worker.wait_exit(30) == 0, worker.describe()


@contextlib.contextmanager
def worker_role(db: Database) -> Iterator[tuple[str, str]]:
    """A login role with every privilege on pgtask's tables, and its URL; dropped at the end."""
    role = f"worker_{uuid.uuid4().hex[:10]}"
    db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        db.execute(f"GRANT USAGE ON SCHEMA pgtask TO {role}")
        db.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA pgtask TO {role}")
        db.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA pgtask TO {role}")
        db.execute(f"GRANT ALL ON acceptance_runs TO {role}")
        url = db.url.replace("postgres@", f"{role}@", 1)
        assert url != db.url
        yield role, url
    finally:
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :role",
            role=role,
        )
        db.execute(f"DROP OWNED BY {role}")
        db.execute(f"DROP ROLE {role}")


def test_a_loop_that_fails_for_good_ends_the_process_with_exit_1(
    db: Database, workers: WorkerLauncher
) -> None:
    with worker_role(db) as (role, url):
        [task_id] = db.enqueue("job", {"sleep": 2.0})
        worker = workers.start("--database-url", url)
        # The role loses a privilege the outcome writer needs: no retry can fix that.
        db.execute(f"REVOKE UPDATE ON pgtask.attempts FROM {role}")
        code = worker.wait_exit(60)
        assert code == 1, worker.describe()
        log = worker.log()
        assert "completer loop failed" in log
        assert "Traceback" not in log.split("pgtask: error:")[-1]
        assert db.state(task_id) == "running"  # left to recovery, not renewed by a zombie
        wait_until(
            lambda: not db.scalar(
                "SELECT bool_or(expires_at > statement_timestamp()) FROM pgtask.workers"
            ),
            10, message="the crashed worker to be gone from the live workers",
        )


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_producer_loop_crash_prints_one_error_line_and_a_traceback_only_at_debug(
    db: Database, workers: WorkerLauncher, level: str
) -> None:
    with worker_role(db) as (role, url):
        worker = workers.start("--database-url", url, "--log-level", level)
        # The claim needs to update pgtask.tasks: without the privilege no retry helps.
        db.execute(f"REVOKE UPDATE ON pgtask.tasks FROM {role}")
        db.enqueue("job", {"sleep": 0.0})
        assert worker.wait_exit(60) == 1, worker.describe()
        log = worker.log()

    [error] = [line for line in log.splitlines() if line.startswith("pgtask: error:")]
    assert error == (
        "pgtask: error: the worker's producer loop failed: database error 42501: permission"
        " denied for table tasks (the database role lacks a privilege pgtask needs)"
    ), log
    assert log.rstrip().endswith(error), log
    [failed] = [
        line for line in log.splitlines()
        if "producer loop failed" in line and not line.startswith("pgtask: error:")
    ]
    assert "InsufficientPrivilege: permission denied for table tasks; stopping" in failed, log
    if level == "debug":
        assert "Traceback (most recent call last)" in log, log
    else:
        # No traceback, no statement, no parameters: one line for the crash, one for the exit.
        assert "Traceback" not in log, log
        assert "SELECT" not in log, log
        assert "[SQL:" not in log, log


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_worker_runs_tasks_and_drains_on_either_event_loop(
    db: Database, workers: WorkerLauncher, loop: str
) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    worker = workers.start("--loop", loop)
    task_ids = db.enqueue("job", {"sleep": 0.01}, count=20)
    [settings] = db.enqueue("collector")
    wait_until(
        lambda: db.all_in([*task_ids, settings], "succeeded"), 30,
        message="the tasks to succeed", describe=worker.describe,
    )
    # The cycle collector runs less often while the worker runs (worker.run).
    result = db.task(settings).result
    assert result["threshold"] >= COLLECTOR_THRESHOLD, result
    assert result["frozen"] > 0, result
    [running] = db.enqueue("job", {"sleep": 0.5})
    wait_until(lambda: db.state(running) == "running", 30, message="the long task to start")
    worker.send(signal.SIGTERM)
    assert worker.wait_exit(30) == 0, worker.describe()
    assert db.state(running) == "succeeded"  # drained: it finished within the grace period
    assert f"event loop: {loop}" in worker.log()
