"""The observer level reads everything the read-only dashboard shows: docs/dashboard.md says a
role with the observer's grants is enough for every page, the task search included.

A search by idempotency key reads ``pgtask.idempotency_keys`` (the task holding the key's
reservation), so the observer needs ``SELECT`` there; writing keys stays the producer's.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, insert, text
from starlette.testclient import TestClient

from sqlalchemy_pgtask import enqueue
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.models import Checkpoint
from tests.support.roles import login_roles, refused, role_engine


def test_an_observer_finds_a_task_by_its_idempotency_key_in_the_read_only_dashboard(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    key = f"order-{uuid.uuid4().hex[:8]}"
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job", idempotency_key=key).id
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.observer) as observer,
        TestClient(create_app(observer), follow_redirects=False) as client,
    ):
        response = client.get("/tasks", params={"q": key})
        assert response.status_code == 200, response.text[:500]
        assert str(task_id) in response.text
        # Reading keys is all: the observer still writes none.
        with refused(), observer.begin() as connection:
            connection.execute(text("DELETE FROM pgtask.idempotency_keys"))


def test_an_observer_opens_a_workflows_task_page_with_its_reasons_and_timeline(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job").id
        # A signal's checkpoint: the timeline then reads pgtask.signals for its name.
        owner.execute(insert(Checkpoint).values(
            task_id=task_id, version=1, step="await-approval", occurrence=0, kind="signal",
            value={"signal": True},
        ))
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.observer) as observer,
        TestClient(create_app(observer), follow_redirects=False) as client,
    ):
        response = client.get(f"/tasks/{task_id}")
        assert response.status_code == 200, response.text[:500]
        assert 'data-testid="explain"' in response.text
        assert 'data-testid="timeline-drawing"' in response.text
        assert "tl-kind-signal" in response.text
