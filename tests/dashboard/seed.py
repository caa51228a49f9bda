"""seed: a small, realistic pgtask database for the dashboard's tests and screenshots.

Tasks are enqueued through the library; what only a worker would write (a failure with its
attempt and traceback, a live worker holding a lease, a finished task) is set with plain
statements, so the seed takes a fraction of a second and needs no handler. Two tasks carry
script in their payload and error, which every page must show as inert text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import Connection, Engine, func, insert, text, update

from sqlalchemy_pgtask import configure_queue, enqueue, pause_queue, set_schedule
from sqlalchemy_pgtask.models import Attempt, Task, WorkerCapability, WorkerRecord

__all__ = [
    "BULK_TASKS", "XSS_ERROR", "XSS_PAYLOAD", "Seeded", "fail_task", "seed", "succeed_task",
]

#: Markup that runs script if any page fails to escape it.
XSS_PAYLOAD: Final = "<script>window.__xss=1</script><img src=x onerror=\"window.__xss=2\">"
XSS_ERROR: Final = "<img src=x onerror=\"window.__xss=3\"><script>window.__xss=4</script>"

#: Tasks of the ``emails`` queue besides the named ones: enough for several pages.
BULK_TASKS: Final = 45

_TRACEBACK: Final = (
    "Traceback (most recent call last):\n"
    '  File "app/tasks.py", line 42, in send_email\n'
    "    smtp.send(message)\n"
    f"smtplib.SMTPDataError: {XSS_ERROR}\n"
)


@dataclass(frozen=True)
class Seeded:
    """The ids of the tasks the tests look at."""

    failed: uuid.UUID
    pending: uuid.UUID
    parent: uuid.UUID
    children: tuple[uuid.UUID, ...]
    running: uuid.UUID
    succeeded: uuid.UUID
    worker: uuid.UUID


def fail_task(connection: Connection, task_id: uuid.UUID, error: dict[str, Any]) -> None:
    connection.execute(insert(Attempt).values(
        task_id=task_id, attempt=1, lease_token=uuid.uuid4(), state="failed",
        finished_at=text("now()"), error=error,
    ))
    connection.execute(update(Task).where(Task.id == task_id).values(
        state="failed", attempt=1, failed_attempts=1, max_attempts=1, error=error,
        completed_at=text("now()"),
    ))


def succeed_task(connection: Connection, task_id: uuid.UUID, result: Any) -> None:
    connection.execute(insert(Attempt).values(
        task_id=task_id, attempt=1, lease_token=uuid.uuid4(), state="succeeded",
        finished_at=text("now()"),
    ))
    connection.execute(update(Task).where(Task.id == task_id).values(
        state="succeeded", attempt=1, max_attempts=3, result=result, completed_at=text("now()"),
    ))


def _worker(connection: Connection, running: uuid.UUID) -> uuid.UUID:
    worker_id = uuid.uuid4()
    connection.execute(insert(WorkerRecord).values(
        id=worker_id, queues=["emails", "reports", "default"], version="0.1.0",
        hostname="worker-1.internal", pid=4242, concurrency=8,
        expires_at=text("now() + interval '1 hour'"),
    ))
    connection.execute(insert(WorkerCapability), [
        {"worker_id": worker_id, "queue": queue, "name": name, "version": 1}
        for queue, name in (
            ("emails", "emails.send"), ("reports", "reports.build"),
            ("default", "orders.fulfil"), ("default", "orders.ship"),
        )
    ])
    lease = uuid.uuid4()
    connection.execute(insert(Attempt).values(
        task_id=running, attempt=1, lease_token=lease, worker_id=worker_id, state="running",
    ))
    connection.execute(update(Task).where(Task.id == running).values(
        state="running", attempt=1, max_attempts=3, lease_token=lease, lease_owner=worker_id,
        lease_expires_at=text("now() + interval '30 seconds'"),
    ))
    return worker_id


def seed(engine: Engine, *, bulk: int = BULK_TASKS) -> Seeded:
    """Fill the (migrated, empty) database behind ``engine``; returns the named tasks."""
    with engine.begin() as connection:
        configure_queue(connection, "emails", rate_limit=50, rate_period=1.0,
                        max_outstanding_tasks=10_000, actor="seed")
        configure_queue(connection, "reports", actor="seed")
        ids = [
            enqueue(connection, "emails.send", {"to": f"user{i}@example.com", "kind": "welcome"},
                    queue="emails", idempotency_key=f"signup-{i}").id
            for i in range(bulk)
        ]
        failed = enqueue(connection, "emails.send", {"to": "mallory@example.com",
                         "subject": XSS_PAYLOAD}, queue="emails",
                         idempotency_key="order-xss", headers={"trace": XSS_PAYLOAD}).id
        fail_task(connection, failed, {
            "type": "handler_error", "exception": "smtplib.SMTPDataError",
            "message": XSS_ERROR, "traceback": _TRACEBACK,
        })
        pending = enqueue(connection, "reports.build", {"month": "2026-11"}, queue="reports").id
        parent = enqueue(connection, "orders.fulfil", {"order": 1017}, priority=5).id
        children = tuple(
            enqueue(connection, "orders.ship", {"order": 1017, "parcel": n}).id for n in (1, 2)
        )
        connection.execute(update(Task).where(Task.id.in_(children)).values(parent_id=parent))
        connection.execute(update(Task).where(Task.id == parent).values(has_children=True))
        succeeded = ids[0]
        succeed_task(connection, succeeded, {"message_id": "<20261201@mail.example.com>"})
        for other in ids[1:4]:
            succeed_task(connection, other, {"ok": True})
        running = ids[4]
        worker = _worker(connection, running)
        # Spread creation times so the list has an order worth paging through.
        for age, task_id in enumerate(reversed([*ids, failed, pending, parent, *children])):
            connection.execute(update(Task).where(Task.id == task_id).values(
                created_at=func.now() - timedelta(minutes=age)
            ))
        pause_queue(connection, "reports", actor="alice", reason="month-end freeze")
        set_schedule(connection, "nightly-report", task="reports.build", cron="0 3 * * *",
                     queue="reports", payload={"kind": "daily"}, actor="seed")
    return Seeded(
        failed=failed, pending=pending, parent=parent, children=children, running=running,
        succeeded=succeeded, worker=worker,
    )
