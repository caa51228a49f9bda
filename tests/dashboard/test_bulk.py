"""Bulk retry and cancel of the task list's filtered selection: admins only, a first POST that
counts and changes nothing, a confirmed second POST that changes the tasks in one
transaction with one audit entry each, more than 1,000 refused, and a task enqueued between
the two steps left alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, func, select, update
from starlette.testclient import TestClient

from sqlalchemy_pgtask import EnqueueRequest, configure_queue, enqueue, enqueue_many
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.models import Task
from tests.dashboard.conftest import TOKEN, snapshot
from tests.dashboard.seed import Seeded, fail_task
from tests.dashboard.test_actions import csrf, log_in, state_of
from tests.support.roles import login_roles, role_engine

AS_OF = re.compile(r'name="as_of" value="([^"]+)"')


def _fail_emails(engine: Engine, count: int) -> list[Any]:
    """Fail ``count`` pending tasks of the seeded ``emails`` queue; their ids."""
    with engine.begin() as connection:
        ids = list(connection.execute(
            select(Task.id).where(Task.queue == "emails", Task.state == "pending")
            .order_by(Task.id).limit(count)
        ).scalars())
        for task_id in ids:
            fail_task(connection, task_id, {"type": "handler_error", "message": "boom"})
    return ids


def _admin(client_for: Callable[..., TestClient]) -> TestClient:
    client = client_for(admin_token=TOKEN)
    log_in(client, "carol")
    return client


def _post(client: TestClient, action: str, **fields: str) -> Any:
    return client.post(f"/tasks/bulk/{action}", data={"csrf_token": csrf(client), **fields})


def _confirm(client: TestClient, action: str, first: Any, **fields: str) -> Any:
    found = AS_OF.search(first.text)
    assert found is not None
    return _post(client, action, **fields, as_of=found.group(1), confirm="yes")


def _entries(engine: Engine, action: str) -> list[Any]:
    with engine.connect() as connection:
        return [e for e in list_audit(connection, limit=500) if e.action == action]


def test_bulk_retry_counts_first_then_retries_each_task_with_its_own_audit_entry(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    failed = [*_fail_emails(pgtask_engine, 5), seeded.failed]
    client = _admin(client_for)
    before = snapshot(pgtask_engine)

    first = _post(client, "retry", state="failed", queue="emails")

    assert first.status_code == 200
    assert "6 tasks will be retried" in first.text
    assert "<code>emails</code>" in first.text
    assert "<code>failed</code>" in first.text
    assert snapshot(pgtask_engine) == before

    done = _confirm(client, "retry", first, state="failed", queue="emails", reason="smtp fixed")

    assert done.status_code == 200
    assert "6 tasks retried" in done.text
    assert {state_of(pgtask_engine, t) for t in failed} == {"pending"}
    entries = _entries(pgtask_engine, "task.retry")
    assert sorted(e.task_id for e in entries) == sorted(failed)
    assert {(e.actor, e.reason) for e in entries} == {("dashboard:carol", "smtp fixed")}


def test_bulk_cancel_cancels_unfinished_tasks_and_asks_running_ones_to_stop(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = _admin(client_for)

    first = _post(client, "cancel", queue="emails", name="emails.send")

    # 40 pending and 1 running; the failed and succeeded ones are not cancellable.
    assert "41 tasks will be cancelled" in first.text
    done = _confirm(client, "cancel", first, queue="emails", name="emails.send")

    assert done.status_code == 200
    assert "40 tasks cancelled" in done.text
    assert "cancellation requested for 1 running task" in done.text
    assert state_of(pgtask_engine, seeded.failed) == "failed"
    assert state_of(pgtask_engine, seeded.pending) == "pending"  # another queue
    with pgtask_engine.connect() as connection:
        states = dict(connection.execute(
            select(Task.state, func.count()).where(Task.queue == "emails").group_by(Task.state)
        ).all())
    assert states == {"cancelled": 40, "running": 1, "succeeded": 4, "failed": 1}
    assert len(_entries(pgtask_engine, "task.cancel")) == 41


def test_more_than_a_thousand_tasks_are_refused_at_either_step_and_nothing_changes(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    with pgtask_engine.begin() as connection:
        enqueue_many(connection, [EnqueueRequest(name="bulk.job", queue="bulky")] * 1001)
    client = _admin(client_for)
    before = snapshot(pgtask_engine)

    first = _post(client, "cancel", queue="bulky")
    forced = _post(client, "cancel", queue="bulky", as_of="9999-01-01T00:00:00+00:00",
                   confirm="yes")

    assert first.status_code == forced.status_code == 409
    assert "More than 1,000 tasks match" in first.text
    assert "More than 1,000 tasks match" in forced.text
    assert snapshot(pgtask_engine) == before


def test_a_task_enqueued_between_count_and_confirmation_is_left_alone(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = _admin(client_for)
    first = _post(client, "cancel", queue="reports")
    assert "1 task will be cancelled" in first.text
    with pgtask_engine.begin() as connection:
        late = enqueue(connection, "reports.build", {"month": "2026-12"}, queue="reports").id
        # Created after the count in any clock: the database's own now, moved on.
        connection.execute(update(Task).where(Task.id == late).values(
            created_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 1)
        ))

    done = _confirm(client, "cancel", first, queue="reports")

    assert "1 task cancelled" in done.text
    assert state_of(pgtask_engine, seeded.pending) == "cancelled"
    assert state_of(pgtask_engine, late) == "pending"


def test_bulk_actions_need_the_admin_and_the_csrf_token_and_a_known_filter(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    read_only, admin = client_for(), _admin(client_for)
    before = snapshot(pgtask_engine)

    anonymous = _post(read_only, "retry", state="failed")
    no_csrf = admin.post("/tasks/bulk/retry", data={"state": "failed"})
    unknown = _post(admin, "retry", state="failed", priority="5")
    no_such = _post(admin, "delete", state="failed")
    bad_state = _post(admin, "retry", state="exploded")
    long_reason = _post(admin, "retry", state="failed", confirm="yes",
                        as_of="9999-01-01T00:00:00+00:00", reason="x" * 1001)

    assert anonymous.status_code == 403
    assert "needs the admin token" in anonymous.text
    assert no_csrf.status_code == 403
    assert "CSRF" in no_csrf.text
    assert unknown.status_code == 400
    assert "not a filter bulk actions know" in unknown.text
    assert no_such.status_code == 404
    assert bad_state.status_code == 400
    assert long_reason.status_code == 400
    assert snapshot(pgtask_engine) == before


def test_the_task_list_offers_bulk_actions_with_its_filters_to_admins_only(
    client_for: Callable[..., TestClient], seeded: Seeded
) -> None:
    read_only, admin = client_for(), _admin(client_for)

    anonymous = read_only.get("/tasks?state=failed&queue=emails")
    page = admin.get("/tasks?state=failed&queue=emails")

    assert 'data-testid="bulk"' not in anonymous.text
    assert 'action="/tasks/bulk/retry"' in page.text
    assert 'action="/tasks/bulk/cancel"' in page.text
    assert '<input type="hidden" name="state" value="failed">' in page.text
    assert '<input type="hidden" name="queue" value="emails">' in page.text


def test_no_matching_task_says_so_and_offers_no_confirmation(
    client_for: Callable[..., TestClient], seeded: Seeded
) -> None:
    answer = _post(_admin(client_for), "retry", queue="nothing-here")

    assert answer.status_code == 200
    assert "nothing to do" in answer.text
    assert 'name="confirm"' not in answer.text


def test_the_confirmation_page_echoes_a_markup_filter_as_inert_text(
    client_for: Callable[..., TestClient], seeded: Seeded
) -> None:
    markup = '"><script>window.__xss=9</script>'

    answer = _post(_admin(client_for), "cancel", q=markup)

    assert answer.status_code == 200
    assert "<script>window.__xss" not in answer.text
    assert "&lt;script&gt;window.__xss=9&lt;/script&gt;" in answer.text


def test_a_full_queue_rolls_the_whole_bulk_retry_back(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    failed = [*_fail_emails(pgtask_engine, 5), seeded.failed]
    with pgtask_engine.begin() as connection:
        # 35 pending and 1 running are outstanding: room for two retries, not six.
        configure_queue(connection, "emails", max_outstanding_tasks=38)
    client = _admin(client_for)
    first = _post(client, "retry", state="failed", queue="emails")
    before = snapshot(pgtask_engine)

    done = _confirm(client, "retry", first, state="failed", queue="emails")

    assert done.status_code == 409
    assert snapshot(pgtask_engine) == before
    assert {state_of(pgtask_engine, t) for t in failed} == {"failed"}


def test_children_cancelled_with_their_parent_are_counted_as_such(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = _admin(client_for)
    first = _post(client, "cancel", queue="default")
    assert "3 tasks will be cancelled" in first.text  # the parent and its two children

    done = _confirm(client, "cancel", first, queue="default")

    assert done.status_code == 200
    text = " ".join(done.text.split())
    assert "1 task cancelled; 2 had already been cancelled with their parents" in text
    assert {state_of(pgtask_engine, t) for t in (seeded.parent, *seeded.children)} == {
        "cancelled"
    }
    assert [e.task_id for e in _entries(pgtask_engine, "task.cancel")] == [seeded.parent]


def test_a_payload_filter_narrows_the_selection(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = _admin(client_for)
    wanted = '{"to": "user7@example.com"}'
    page = client.get("/tasks", params={"queue": "emails", "payload": wanted})
    assert 'name="payload" value="{&#34;to&#34;: &#34;user7@example.com&#34;}"' in page.text

    first = _post(client, "cancel", queue="emails", payload=wanted)
    done = _confirm(client, "cancel", first, queue="emails", payload=wanted)
    bad = _post(client, "cancel", payload="[1, 2]")

    assert "1 task will be cancelled" in first.text
    assert "1 task cancelled" in done.text
    [entry] = _entries(pgtask_engine, "task.cancel")
    with pgtask_engine.connect() as connection:
        payload = connection.scalar(select(Task.payload).where(Task.id == entry.task_id))
    assert payload == {"to": "user7@example.com", "kind": "welcome"}
    assert bad.status_code == 400


def test_bulk_actions_work_on_the_admin_level_of_pgtask_grants(
    pgtask_database_url: str, pgtask_engine: Engine, seeded: Seeded
) -> None:
    """The selection's row locks and each retry and cancel need no more than the admin
    level's grants (docs/roles.md)."""
    failed = _fail_emails(pgtask_engine, 2)
    with login_roles(pgtask_database_url) as roles, \
            role_engine(pgtask_database_url, roles.admin) as admin, \
            TestClient(create_app(admin, admin_token=TOKEN), follow_redirects=False) as client:
        log_in(client, "carol")
        retry_first = _post(client, "retry", state="failed", queue="emails")
        retried = _confirm(client, "retry", retry_first, state="failed", queue="emails")
        cancel_first = _post(client, "cancel", queue="reports")
        cancelled = _confirm(client, "cancel", cancel_first, queue="reports")

    assert "3 tasks retried" in retried.text
    assert "1 task cancelled" in cancelled.text
    assert {state_of(pgtask_engine, t) for t in [*failed, seeded.failed]} == {"pending"}
    assert state_of(pgtask_engine, seeded.pending) == "cancelled"
