"""A durable workflow survives ``kill -9`` of its worker at every durable point (docs/durable.md).

Real ``pgtask worker durable_app:registry`` processes (`tests.support.durable_app`) run the
workflow ``charge`` (a step whose body records each run) -> ``record-order`` (a fenced
transaction writing a business row) -> ``nap`` (a durable sleep) -> ``await-approval`` (a signal
wait) -> ``ship`` (a spawned child, which records each run too) -> ``await-shipment`` (the wait
for the child's result). The test kills the worker with SIGKILL where the handler sits right
after a durable call committed (it waits there for a file the test controls, after recording
that it arrived), or while the task sleeps or waits and no handler runs at all; then it starts
a new worker process and drives the workflow on (moves the database clock, emits the signal,
lets the child finish). Time moves with the database clock; every wait is a poll with a
deadline.

What survives is what was committed: a step's body whose checkpoint committed never runs
again, the business row exists once, the spawned child is the one the parent adopts after each
kill, and the kills show in the attempts as lost ones (suspensions are not failures, so the
workflow takes more attempts than its budget allows failures). The one exception is the
documented at-least-once window: a kill between a step's body and its checkpoint runs the body
again.
"""

from __future__ import annotations

import signal
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from sqlalchemy_pgtask import emit_signal
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.support.durable_app import (
    CHILD,
    CHILD_MAX_ATTEMPTS,
    WORKFLOW,
    WORKFLOW_MAX_ATTEMPTS,
    DurableLauncher,
    create_durable_tables,
    release,
    write_durable_app,
)
from tests.support.waiting import PATIENCE, wait_until
from tests.support.workerproc import Database, WorkerProcess, describe_all

#: The workflow's durable sleep: an hour of database time, which the test moves past.
NAP: Final = 3600.0

TERMINAL: Final = ("succeeded", "failed", "cancelled")


@pytest.fixture
def durable_dir(tmp_path: Path) -> Path:
    """The workers' working directory, holding ``durable_app.py`` and the release files."""
    write_durable_app(tmp_path)
    return tmp_path


@pytest.fixture
def launcher(durable_dir: Path, db: Database) -> Iterator[DurableLauncher]:
    create_durable_tables(db)
    workers = DurableLauncher(durable_dir, db)
    try:
        yield workers
    finally:
        workers.close()


# -- reading the database --------------------------------------------------------------------


def marks(db: Database, task_id: uuid.UUID) -> dict[str, list[int]]:
    """The attempts of ``task_id`` that passed each point, in order."""
    passed: dict[str, list[int]] = defaultdict(list)
    for row in db.rows(
        "SELECT point, attempt FROM durable_marks WHERE task_id = :id ORDER BY attempt, at",
        id=task_id,
    ):
        passed[row.point].append(row.attempt)
    return dict(passed)


def runs(db: Database, task_id: uuid.UUID, body: str) -> list[int]:
    """The attempts of ``task_id`` that ran ``body``, one entry per run."""
    return [
        row.attempt
        for row in db.rows(
            "SELECT attempt FROM durable_runs WHERE task_id = :id AND body = :body"
            " ORDER BY attempt, at",
            id=task_id, body=body,
        )
    ]


def checkpoints(db: Database, task_id: uuid.UUID) -> dict[str, str]:
    """The task's checkpoints: step name -> kind."""
    rows = db.rows(
        "SELECT step, kind FROM pgtask.checkpoints WHERE task_id = :id AND occurrence = 0",
        id=task_id,
    )
    return {row.step: row.kind for row in rows}


def orders(db: Database) -> list[tuple[int, uuid.UUID, int]]:
    """Every business row: (id, task, attempt that wrote it)."""
    return [
        (row.id, row.task_id, row.attempt)
        for row in db.rows("SELECT id, task_id, attempt FROM durable_orders ORDER BY id")
    ]


def children(db: Database, task_id: uuid.UUID) -> list[uuid.UUID]:
    return [
        row.id for row in db.rows("SELECT id FROM pgtask.tasks WHERE parent_id = :id", id=task_id)
    ]


def attempts(db: Database, task_id: uuid.UUID) -> list[tuple[int, str, uuid.UUID]]:
    """(attempt, state, worker) of each attempt of the task."""
    return [(a.attempt, a.state, a.worker_id) for a in db.attempts(task_id)]


# -- driving the workers ---------------------------------------------------------------------


def kill(worker: WorkerProcess) -> None:
    """``kill -9`` the worker and reap it: nothing of it runs after this returns."""
    worker.send(signal.SIGKILL)
    assert worker.wait_exit(10) == -signal.SIGKILL, worker.describe()


def wait_mark(
    db: Database, launcher: DurableLauncher, task_id: uuid.UUID, point: str, attempt: int
) -> None:
    """Wait until attempt ``attempt`` of ``task_id`` passed (or sits at) ``point``."""

    def arrived() -> bool:
        state = db.state(task_id)
        assert state not in TERMINAL, f"task {task_id} ended {state} before {point!r}"
        return attempt in marks(db, task_id).get(point, [])

    wait_until(
        arrived, PATIENCE, message=f"attempt {attempt} of {task_id} at {point!r}",
        describe=describe_all(launcher.processes),
    )


def wait_suspended(
    db: Database, launcher: DurableLauncher, task_id: uuid.UUID, attempt: int, task_state: str
) -> None:
    """Wait until attempt ``attempt`` ended suspended and the task is ``task_state``."""

    def suspended() -> bool:
        rows = db.attempts(task_id)
        state = db.state(task_id)
        assert state not in TERMINAL, f"task {task_id} ended {state}"
        return len(rows) >= attempt and rows[attempt - 1].state == "suspended" and (
            state == task_state
        )

    wait_until(
        suspended, PATIENCE, message=f"attempt {attempt} of {task_id} to suspend ({task_state})",
        describe=describe_all(launcher.processes),
    )


def wait_finished(db: Database, launcher: DurableLauncher, task_id: uuid.UUID) -> Any:
    wait_until(
        lambda: db.state(task_id) in TERMINAL, PATIENCE, message=f"{task_id} to finish",
        describe=describe_all(launcher.processes),
    )
    task = db.task(task_id)
    assert task.state == "succeeded", (task.state, task.error)
    return task


def approve(db: Database, task_id: uuid.UUID, value: Any) -> None:
    with db.engine.begin() as conn:
        emit_signal(conn, task_id, "approval", value)


# -- the tests -------------------------------------------------------------------------------


def test_a_workflow_killed_at_every_durable_point_finishes_with_each_effect_once(
    db: Database, durable_dir: Path, launcher: DurableLauncher
) -> None:
    clock = DatabaseClock(db.engine)
    first = launcher.start()
    [task_id] = db.enqueue(
        WORKFLOW,
        {"order": 7, "nap": NAP, "hold": ["charged", "recorded", "spawned", "shipping"]},
    )

    # 1. Right after a step: charge's checkpoint committed, the handler sits at "charged".
    wait_mark(db, launcher, task_id, "charged", 1)
    assert checkpoints(db, task_id) == {"charge": "step"}
    assert runs(db, task_id, "charge") == [1]
    kill(first)
    release(durable_dir, "charged")
    second = launcher.start()

    # 2. Right after the fenced transaction: its business row and checkpoint committed.
    wait_mark(db, launcher, task_id, "recorded", 2)
    assert checkpoints(db, task_id) == {"charge": "step", "record-order": "transaction"}
    written = orders(db)
    assert [(owner, attempt) for _, owner, attempt in written] == [(task_id, 2)], (
        f"the fenced transaction's checkpoint committed with business rows {written}"
    )
    order_id = written[0][0]
    kill(second)
    release(durable_dir, "recorded")
    third = launcher.start()

    # 3. During the sleep: the task is pending at its wake time, leased by nobody.
    wait_suspended(db, launcher, task_id, 3, "pending")
    sleeping = db.row(
        "SELECT lease_owner, run_at - pgtask.now() > interval '30 minutes' AS later"
        " FROM pgtask.tasks WHERE id = :id",
        id=task_id,
    )
    assert sleeping is not None
    assert (sleeping.lease_owner, sleeping.later) == (None, True)
    assert checkpoints(db, task_id)["nap"] == "sleep"
    kill(third)
    fourth = launcher.start()
    clock.advance(NAP)  # the hour passes while the new worker runs

    # 4. While waiting for the signal: no handler runs; the signal wakes the task with no
    # worker alive, in the sender's transaction.
    wait_suspended(db, launcher, task_id, 4, "waiting")
    kill(fourth)
    approve(db, task_id, {"by": "ann"})
    assert db.state(task_id) == "pending"
    fifth = launcher.start()

    # 5. Right after the spawn: the child's id is checkpointed and the child runs (held).
    wait_mark(db, launcher, task_id, "spawned", 5)
    [child_id] = children(db, task_id)
    assert checkpoints(db, task_id)["ship"] == "spawn"
    wait_mark(db, launcher, child_id, "shipping", 1)
    kill(fifth)
    release(durable_dir, "spawned")
    sixth = launcher.start()

    # 6. While waiting for the child: the parent waits (no slot), its child runs (held).
    wait_suspended(db, launcher, task_id, 6, "waiting")
    wait_mark(db, launcher, child_id, "shipping", 2)
    assert children(db, task_id) == [child_id], "the replayed spawn made another child"
    kill(sixth)
    release(durable_dir, "shipping")
    seventh = launcher.start()

    task = wait_finished(db, launcher, task_id)
    workers = [first, second, third, fourth, fifth, sixth, seventh]

    # Each kill is a lost attempt; sleeping and waiting are suspensions, not failures.
    assert attempts(db, task_id) == [
        (1, "lost", first.worker_id),
        (2, "lost", second.worker_id),
        (3, "suspended", third.worker_id),
        (4, "suspended", fourth.worker_id),
        (5, "lost", fifth.worker_id),
        (6, "suspended", sixth.worker_id),
        (7, "succeeded", seventh.worker_id),
    ]
    # Lost: its lease expired, or (when a live worker knew it) its worker was seen gone.
    assert db.attempts(task_id)[0].error["type"] == "lease_expired"
    assert (task.attempt, task.failed_attempts, task.max_attempts) == (
        7, 3, WORKFLOW_MAX_ATTEMPTS,
    )
    assert task.attempt > task.max_attempts > task.failed_attempts

    # The step's body ran once (its checkpoint committed before the first kill); the
    # business row exists once; one child exists and the result names it.
    assert runs(db, task_id, "charge") == [1]
    assert orders(db) == [(order_id, task_id, 2)]
    assert children(db, task_id) == [child_id]
    assert db.scalar("SELECT count(*) FROM pgtask.tasks") == 2
    assert task.result == {
        "charge": {"charged": 7, "attempt": 1},
        "order": {"order_id": order_id, "attempt": 2},
        "approval": {"by": "ann"},
        "child": str(child_id),
        "shipment": {"state": "succeeded", "result": {"tracking": "T-7", "attempt": 3}},
        "attempt": 7,
    }
    assert checkpoints(db, task_id) == {
        "charge": "step",
        "record-order": "transaction",
        "nap": "sleep",
        "await-approval": "signal",
        "ship": "spawn",
        "await-shipment": "result",
    }
    # Every attempt replayed from the top and passed each point it reached; the step's body
    # (where "charging" is) ran in the first attempt only.
    assert marks(db, task_id) == {
        "charging": [1],
        "charged": [1, 2, 3, 4, 5, 6, 7],
        "recorded": [2, 3, 4, 5, 6, 7],
        "rested": [4, 5, 6, 7],
        "approved": [5, 6, 7],
        "spawned": [5, 6, 7],
        "shipped": [7],
    }

    # The child has no checkpoints of its own: its body ran again after each kill.
    child = db.task(child_id)
    assert (child.name, child.state, child.parent_id) == (CHILD, "succeeded", task_id)
    assert attempts(db, child_id) == [
        (1, "lost", fifth.worker_id),
        (2, "lost", sixth.worker_id),
        (3, "succeeded", seventh.worker_id),
    ]
    assert (child.failed_attempts, child.max_attempts) == (2, CHILD_MAX_ATTEMPTS)
    assert runs(db, child_id, "ship") == [1, 2, 3]
    assert seventh.alive()
    assert all(not w.alive() for w in workers[:-1])


def test_a_kill_between_a_steps_body_and_its_checkpoint_runs_the_body_again(
    db: Database, durable_dir: Path, launcher: DurableLauncher
) -> None:
    first = launcher.start()
    [task_id] = db.enqueue(WORKFLOW, {"order": 8, "nap": 0, "hold": ["charging"]})
    approve(db, task_id, {"by": "bob"})  # sent before anyone waits: kept until asked

    # Inside charge's body: its run is recorded (the external effect), its checkpoint is not.
    wait_mark(db, launcher, task_id, "charging", 1)
    assert runs(db, task_id, "charge") == [1]
    assert checkpoints(db, task_id) == {}
    kill(first)
    release(durable_dir, "charging")
    second = launcher.start()

    task = wait_finished(db, launcher, task_id)
    # The documented window: the body ran again, and the second run's result is the one
    # stored; everything after it happened once.
    assert runs(db, task_id, "charge") == [1, 2]
    assert marks(db, task_id)["charging"] == [1, 2]
    assert task.result["charge"] == {"charged": 8, "attempt": 2}
    written = orders(db)
    assert [(owner, attempt) for _, owner, attempt in written] == [(task_id, 2)], written
    order_id = written[0][0]
    assert task.result["order"] == {"order_id": order_id, "attempt": 2}
    assert task.result["approval"] == {"by": "bob"}
    [child_id] = children(db, task_id)
    assert task.result["child"] == str(child_id)
    assert task.result["shipment"]["state"] == "succeeded"
    assert runs(db, child_id, "ship") == [1]

    history = attempts(db, task_id)
    assert history[0] == (1, "lost", first.worker_id)
    assert history[-1][1:] == ("succeeded", second.worker_id)
    assert all(state == "suspended" for _, state, _ in history[1:-1])
    assert task.failed_attempts == 1
