"""Turning a queue's capacity off and straight back on never deadlocks with its producers.

Turning a limit on recounts the queue's outstanding tasks under ``LOCK TABLE pgtask.tasks``,
which waits for every transaction that wrote to the table. A producer of a limited queue
writes its task first and then locks the queue row (admission). When the turn-on locked the
queue row before the table, a producer that had written its task and was waiting for that row
(queued behind the turn-off that had just committed) waited for the turn-on, and the turn-on's
recount waited for the producer: a deadlock (40P01), one of them rolled back. The turn-on now
takes the table lock before it holds the queue row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, func, select, text
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import configure_queue, enqueue, list_queues
from sqlalchemy_pgtask.models import Task
from tests.support.waiting import PATIENCE, wait_until

QUEUE = "toggled"


class _Run(threading.Thread):
    """``work`` on its own connection in a thread; keeps what it returned or raised."""

    def __init__(self, engine: Engine, work: Callable[[Connection], Any]) -> None:
        super().__init__(daemon=True)
        self._engine, self._work = engine, work
        self.pid: int | None = None
        self.connected = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self._engine.connect() as connection:
                self.pid = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
                self.connected.set()
                self._work(connection)
                connection.commit()
        except BaseException as exc:
            self.error = exc
            self.connected.set()


def _waiting_for_a_lock(engine: Engine, pid: int) -> bool:
    with engine.connect() as connection:
        return bool(connection.execute(
            text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
            {"pid": pid},
        ).scalar())


def _started_waiting(engine: Engine, run: _Run) -> None:
    run.start()
    assert run.connected.wait(PATIENCE)
    assert run.pid is not None, run.error
    pid = run.pid
    wait_until(lambda: _waiting_for_a_lock(engine, pid) or run.error is not None,
               PATIENCE, message="the thread to wait for a lock")
    assert run.error is None, run.error


def _queued_tasks(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(
            select(func.count()).select_from(Task).where(Task.queue == QUEUE)
        ) or 0)


def test_a_capacity_turned_back_on_never_deadlocks_with_a_producer_waiting_for_the_queue(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, QUEUE, max_outstanding_tasks=100)
    threads = create_engine(pgtask_engine.url, poolclass=NullPool)
    try:
        with pgtask_engine.connect() as turn_off:
            configure_queue(turn_off, QUEUE, max_outstanding_tasks=None)  # holds the queue row
            # The turn-on comes straight after, and waits for the same row...
            turn_on = _Run(threads, lambda c: configure_queue(c, QUEUE, max_outstanding_tasks=100))
            _started_waiting(pgtask_engine, turn_on)
            # ...and so does a producer, which has written its task (its snapshot still
            # shows the limit), behind the turn-on.
            producer = _Run(threads, lambda c: enqueue(c, "job", queue=QUEUE))
            _started_waiting(pgtask_engine, producer)
            turn_off.commit()
        for run in (turn_on, producer):
            run.join(PATIENCE)
            assert not run.is_alive()
    finally:
        threads.dispose()
    assert turn_on.error is None, turn_on.error
    assert producer.error is None, producer.error
    assert _queued_tasks(pgtask_engine) == 1
    with pgtask_engine.connect() as connection:
        [settings] = [q for q in list_queues(connection) if q.name == QUEUE]
    assert (settings.max_outstanding_tasks, settings.outstanding_tasks) == (100, 1)


def test_capacity_toggled_under_concurrent_producers_loses_no_enqueue(
    pgtask_engine: Engine,
) -> None:
    with pgtask_engine.begin() as connection:
        configure_queue(connection, QUEUE, max_outstanding_tasks=10_000)
    producers, per_producer, toggles = 4, 40, 15
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = create_engine(pgtask_engine.url, poolclass=NullPool)

    def produce() -> None:
        with threads.connect() as connection:
            for _ in range(per_producer):
                try:
                    enqueue(connection, "job", queue=QUEUE)
                    connection.commit()
                except BaseException as exc:
                    errors.append(exc)
                    connection.rollback()

    def toggle() -> None:
        with threads.connect() as connection:
            for _ in range(toggles):
                if stop.is_set():
                    return
                for limit in (None, 10_000):
                    try:
                        configure_queue(connection, QUEUE, max_outstanding_tasks=limit)
                        connection.commit()
                    except BaseException as exc:
                        errors.append(exc)
                        connection.rollback()

    workers = [threading.Thread(target=produce) for _ in range(producers)]
    toggler = threading.Thread(target=toggle)
    try:
        for thread in (*workers, toggler):
            thread.start()
        for thread in workers:
            thread.join(PATIENCE)
        stop.set()
        toggler.join(PATIENCE)
        assert not any(t.is_alive() for t in (*workers, toggler))
    finally:
        threads.dispose()
    assert errors == []
    assert _queued_tasks(pgtask_engine) == producers * per_producer
    with pgtask_engine.connect() as connection:
        [settings] = [q for q in list_queues(connection) if q.name == QUEUE]
    assert settings.outstanding_tasks == producers * per_producer
