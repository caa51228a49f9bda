"""A Flask application with Flask-SQLAlchemy: enqueue with ``db.session`` in a request, so the
order and its confirmation task commit together, or roll back together.

Install the schema once, then run the app and a worker, from this directory::

    export PGTASK_DATABASE_URL=postgresql://app@127.0.0.1/app
    pgtask migrate
    flask --app flask_app run                      # the web application
    pgtask worker flask_app:registry               # in another shell

    curl -X POST localhost:5000/orders -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com", "quantity": 2}'   # {"order_id": 1, "task_id": "..."}
    curl localhost:5000/tasks/<task_id>                      # its state, and its result once run

Flask-SQLAlchemy gives each request its own ``db.session``, which is closed (and so rolled
back, if nothing committed it) when the request ends. ``enqueue`` only adds the task to that
session's transaction: ``db.session.commit()`` commits the order and the task at once, and a
request that fails after the enqueue (here: more than `MAX_QUANTITY` items) leaves neither.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqlalchemy_pgtask import Registry, SyncTaskContext, get_task

registry = Registry()

#: The most items one order may hold; a larger order is refused after its task was enqueued,
#: as a payment declined late in the request would be.
MAX_QUANTITY = 10


class Base(DeclarativeBase):
    pass


# Flask-SQLAlchemy adopts the declarative base: `Base.metadata` is `db.metadata`.
db = SQLAlchemy(model_class=Base)


class Order(Base):
    __tablename__ = "flask_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(254))
    quantity: Mapped[int]


@registry.task("send-order-confirmation", queue="emails")
def send_confirmation(ctx: SyncTaskContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Sends the confirmation mail (a stand-in that only says whom it would have written to)."""
    return {"sent_to": payload["email"], "order_id": payload["order_id"]}


def create_app(database_url: str | None = None) -> Flask:
    """The application on ``database_url`` (default ``$PGTASK_DATABASE_URL``), whose pgtask
    schema is installed (``pgtask migrate``)."""
    url = make_url(database_url or os.environ["PGTASK_DATABASE_URL"])
    app = Flask(__name__)
    # The URL an operator writes (postgresql://...) names no driver: use psycopg 3.
    app.config["SQLALCHEMY_DATABASE_URI"] = url.set(drivername="postgresql+psycopg")
    db.init_app(app)
    with app.app_context():
        db.create_all()  # the example's own table; a real application's migrations would

    @app.post("/orders")
    def create_order() -> tuple[dict[str, Any], int]:
        body = request.get_json(silent=True) or {}
        email, quantity = body.get("email"), body.get("quantity", 1)
        if not isinstance(email, str) or "@" not in email or not isinstance(quantity, int):
            return {"error": "an email and a whole quantity, please"}, 422
        order = Order(email=email, quantity=quantity)
        db.session.add(order)
        db.session.flush()  # assigns order.id, which the payload and the key need
        task = send_confirmation.enqueue(
            db.session,
            {"order_id": order.id, "email": order.email},
            idempotency_key=f"order-confirmation-{order.id}",
        )
        if quantity > MAX_QUANTITY:
            # Nothing is committed yet: the rollback takes the order and its task back.
            db.session.rollback()
            return {"error": f"at most {MAX_QUANTITY} items per order"}, 409
        db.session.commit()  # the order and its task, in one transaction
        return {"order_id": order.id, "task_id": str(task.id)}, 201

    @app.get("/tasks/<uuid:task_id>")
    def task_status(task_id: uuid.UUID) -> tuple[dict[str, Any], int]:
        task = get_task(db.session, task_id)
        if task is None:
            return {"error": f"no task {task_id}"}, 404
        return {"id": str(task.id), "state": task.state, "result": task.result}, 200

    return app
