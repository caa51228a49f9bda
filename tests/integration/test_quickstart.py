"""The README's Quickstart, run as written: one receipt task per order, none lost.

The order's id comes from the database, so it exists only once the order is flushed. The
Quickstart flushes before it builds the idempotency key from the id; without the flush every
key would be ``"receipt-None"`` and every receipt after the first would be deduplicated away.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Identity, Text, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqlalchemy_pgtask import EnqueueResult, Registry, SyncTaskContext, Task, TaskContext

README = Path(__file__).resolve().parents[2] / "README.md"
ORDERS = 4


class Base(DeclarativeBase):
    """The application's own models, separate from pgtask's."""


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(Identity(), primary_key=True)  # assigned by the database
    email: Mapped[str] = mapped_column(Text)


@pytest.fixture
def app_engine(pgtask_engine: Engine) -> Engine:
    """The test database with the application's ``orders`` table next to pgtask's schema."""
    Base.metadata.create_all(pgtask_engine)
    return pgtask_engine


def receipts(engine: Engine) -> list[tuple[str | None, Any]]:
    with Session(engine) as session:
        rows = session.execute(
            select(Task.idempotency_key, Task.payload).order_by(Task.idempotency_key)
        )
        return [tuple(row) for row in rows]


def expected(count: int) -> list[tuple[str | None, Any]]:
    return sorted(
        (f"receipt-{n}", {"email": f"customer{n}@example.com"}) for n in range(1, count + 1)
    )


def test_the_flushed_quickstart_enqueues_one_receipt_per_order(app_engine: Engine) -> None:
    registry = Registry()

    @registry.task("send-receipt", queue="emails")
    async def send_receipt(ctx: TaskContext, payload: dict[str, str]) -> str:
        return "sent"

    results: list[EnqueueResult] = []
    for n in range(1, ORDERS + 1):  # one request, one transaction, per order
        order = Order(email=f"customer{n}@example.com")
        with Session(app_engine) as session, session.begin():
            session.add(order)
            session.flush()
            results.append(send_receipt.enqueue(
                session, {"email": order.email}, idempotency_key=f"receipt-{order.id}"
            ))
    assert all(result.created for result in results)
    assert receipts(app_engine) == expected(ORDERS)


def test_an_unflushed_id_is_none_even_after_enqueue_which_is_why_the_quickstart_flushes(
    app_engine: Engine,
) -> None:
    registry = Registry()

    @registry.task("send-receipt")
    def send_receipt(ctx: SyncTaskContext, payload: dict[str, str]) -> None:
        """Never runs here."""

    with Session(app_engine) as session:
        session.add(order := Order(email="a@example.com"))
        send_receipt.enqueue(session, {"email": order.email})
        assert order.id is None  # enqueue never flushes the caller's session
        session.flush()
        assert order.id is not None


def quickstart_blocks() -> list[str]:
    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_readme_quickstart_as_written_enqueues_one_receipt_per_order(
    app_engine: Engine,
) -> None:
    define_tasks, write_business_data = quickstart_blocks()
    tasks: dict[str, Any] = {}
    exec(compile(define_tasks, "README.md (app/tasks.py)", "exec"), tasks)
    for n in range(1, ORDERS + 1):
        scope = {
            "Session": Session, "engine": app_engine, "send_receipt": tasks["send_receipt"],
            "order": Order(email=f"customer{n}@example.com"),
        }
        exec(compile(write_business_data, "README.md (business data)", "exec"), scope)
    assert receipts(app_engine) == expected(ORDERS)
    with Session(app_engine) as session:
        # The capacity example (`pgtask queue set emails ...`) caps the receipts' queue.
        assert set(session.scalars(select(Task.queue))) == {"emails"}
        assert session.scalars(select(Order.id).order_by(Order.id)).all() == list(
            range(1, ORDERS + 1)
        )
