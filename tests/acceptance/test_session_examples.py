"""The examples for the session managers applications already use (issue 27 item 5), against a
real database: Flask-SQLAlchemy's ``db.session`` in a request, and SQLModel's ``Session`` and
``AsyncSession``; each task commits or rolls back with the rows written beside it.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from sqlalchemy_pgtask.testing import drain
from tests.support.examples import load_example, run_example_script
from tests.support.workerproc import Database


def test_flask_example_commits_the_order_with_its_task_and_a_refused_one_leaves_neither(
    db: Database,
) -> None:
    example = load_example("flask_app")
    app = example.create_app(db.url)
    try:
        client = app.test_client()
        invalid = client.post("/orders", json={"email": "not an address"})
        refused = client.post("/orders", json={"email": "bob@example.com", "quantity": 11})
        created = client.post("/orders", json={"email": "ada@example.com", "quantity": 2})
        task_id = created.get_json()["task_id"]
        before = client.get(f"/tasks/{task_id}")
        asyncio.run(drain(example.registry, db.url))  # a real worker, until nothing is due
        after = client.get(f"/tasks/{task_id}")
        unknown = client.get(f"/tasks/{uuid.uuid4()}")
    finally:
        with app.app_context():
            example.db.engine.dispose()

    assert invalid.status_code == 422
    assert refused.status_code == 409, refused.get_data(as_text=True)
    assert created.status_code == 201, created.get_data(as_text=True)
    order_id = created.get_json()["order_id"]
    assert before.get_json()["state"] == "pending"
    assert after.get_json() == {
        "id": task_id,
        "state": "succeeded",
        "result": {"sent_to": "ada@example.com", "order_id": order_id},
    }
    assert unknown.status_code == 404
    # The refused request flushed its order and enqueued its task, and rolled both back.
    assert [tuple(row) for row in db.rows("SELECT id, email, quantity FROM flask_orders")] == [
        (order_id, "ada@example.com", 2)
    ]
    tasks = db.rows("SELECT id::text, idempotency_key FROM pgtask.tasks")
    assert [tuple(row) for row in tasks] == [(task_id, f"order-confirmation-{order_id}")]


def test_sqlmodel_example_enqueues_with_both_sessions_and_counts_each_notes_words(
    pgtask_database_url: str, tmp_path: Path
) -> None:
    out = run_example_script("sqlmodel_app.py", pgtask_database_url, tmp_path)
    assert "enqueued with a Session" in out
    assert "enqueued with an AsyncSession; a rolled-back one is gone" in out
    assert "task succeeded: {'words': 5, 'note_id': 1}" in out
    assert "task succeeded: {'words': 4, 'note_id': 2}" in out
    assert "note 1: 5 words\nnote 2: 4 words\n" in out
