"""Notification loss (failure model, "Notification failures"): NOTIFY is only a hint. A task
whose notification never arrives is found by the worker's reconciliation poll, and a listener
whose connection dies reconnects and claims at once."""

from __future__ import annotations

import functools

import psycopg
import pytest

from tests.support.urls import libpq_url
from tests.support.waiting import PATIENCE, SLOW_POLL, wait_until
from tests.support.workerproc import (
    LISTENER,
    POLL_SECONDS,
    Database,
    WorkerLauncher,
    listener_pids,
    terminate_backends,
)


def test_task_enqueued_without_notify_is_claimed_by_the_poll(
    db: Database, workers: WorkerLauncher
) -> None:
    if not db.scalar("SELECT current_setting('is_superuser') = 'on'"):
        pytest.skip("session_replication_role = replica needs a superuser")
    worker = workers.start(poll=POLL_SECONDS)
    # An observer proves the enqueue below really sends no notification.
    with psycopg.connect(libpq_url(db.url), autocommit=True) as observer:
        observer.execute("LISTEN pgtask_ready")
        # Warm-up with a normal enqueue: the observer does see that one.
        [warm] = db.enqueue("job", {"sleep": 0})
        assert [n.payload for n in observer.notifies(timeout=5, stop_after=1)] == ["default"]
        wait_until(lambda: db.state(warm) == "succeeded", PATIENCE, describe=worker.describe)

        silent = db.enqueue("job", {"sleep": 0}, count=3, replica=True)
        # Nothing else can wake the idle worker: only its poll finds them (the deadline only
        # bounds a hang; how soon does not matter).
        wait_until(
            lambda: db.all_in(silent, "succeeded"), PATIENCE,
            message="the poll to find tasks enqueued without a notification",
            describe=worker.describe,
        )
        # The claims and completions send nothing on pgtask_ready; nor did the enqueue.
        assert list(observer.notifies(timeout=0.2)) == []


def test_worker_claims_after_its_listener_connection_is_killed_repeatedly(
    db: Database, workers: WorkerLauncher
) -> None:
    # A poll interval far beyond the deadlines: only the listener's reconnect or a
    # notification can wake the worker in time.
    worker = workers.start(poll=SLOW_POLL)
    for round_ in range(3):
        [before] = wait_until(lambda: listener_pids(db), PATIENCE, message="a LISTEN backend")
        assert terminate_backends(db, LISTENER) == 1
        # Enqueued while the listener may still be reconnecting: its notification can be lost.
        task_ids = db.enqueue("job", {"sleep": 0}, count=2)
        wait_until(
            functools.partial(db.all_in, task_ids, "succeeded"), PATIENCE,
            message=f"round {round_}: tasks enqueued while the listener was down",
            describe=worker.describe,
        )
        after = wait_until(
            lambda: listener_pids(db), PATIENCE, message="a new LISTEN backend"
        )
        assert before not in after
    assert worker.alive()
