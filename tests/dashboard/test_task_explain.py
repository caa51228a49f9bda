"""The task page's "Why is it in this state" section: `explain`'s reasons, each its code and
its sentence, the same as `explain` gives for that task in the same database, user data in the
sentences (an audit reason, an error message) as inert text."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, event, func, insert, update
from starlette.testclient import TestClient

from sqlalchemy_pgtask import enqueue, explain
from sqlalchemy_pgtask.models import Checkpoint, Task
from tests.dashboard.conftest import Shared
from tests.dashboard.seed import XSS_ERROR
from tests.dashboard.test_task_detail_durable import section, task_page, text_of
from tests.support import durable


def reasons_on(page: str) -> list[tuple[str, str]]:
    """(code, text) of each reason the page lists."""
    return [
        (code, text_of(inner))
        for code, inner in re.findall(
            r'<li class="reason [^"]*" data-code="([a-z_]+)">(.*?)</li>', section(page, "explain"),
            re.S,
        )
    ]


def expected(shared: Shared, task_id: uuid.UUID) -> list[tuple[str, str]]:
    with shared.engine.connect() as connection:
        explanation = explain(connection, task_id)
    return [(r.code, f"{r.code} {r.message}") for r in explanation.reasons]


def test_a_pending_task_in_a_paused_queue_says_so_with_who_paused_it_and_why(
    shared: Shared, shared_client_for: Callable[..., TestClient]
) -> None:
    page = task_page(shared_client_for(), shared.seeded.pending)

    reasons = reasons_on(page)
    assert "queue_paused" in [code for code, _ in reasons]
    paused = dict(reasons)["queue_paused"]
    assert "alice" in paused
    assert "month-end freeze" in paused
    assert reasons == expected(shared, shared.seeded.pending)


def test_a_failed_task_gives_its_error_as_text(
    shared: Shared, shared_client_for: Callable[..., TestClient]
) -> None:
    page = task_page(shared_client_for(), shared.seeded.failed)

    reasons = reasons_on(page)
    assert [code for code, _ in reasons] == ["terminal"]
    assert XSS_ERROR in reasons[0][1]
    assert "<img" not in section(page, "explain")
    assert reasons == expected(shared, shared.seeded.failed)


def test_a_keyed_task_shows_its_key_its_holders_and_why_it_waits(
    pgtask_engine: Engine, client_for: Callable[..., TestClient]
) -> None:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        holder = durable.add_task(conn, concurrency_key="tenant-7", concurrency_limit=1)
        waiter = durable.add_task(conn, concurrency_key="tenant-7", concurrency_limit=1)
        durable.claim_one(conn)

    page = task_page(client_for(), waiter)

    shown = re.search(r'<dd data-testid="concurrency-key">(.*?)</dd>', page, re.S)
    assert shown is not None
    assert "tenant-7" in shown.group(1)
    assert "limit 1" in shown.group(1)
    assert f'href="/tasks/{holder}"' in shown.group(1)
    reasons = dict(reasons_on(page))
    assert f"held by task {holder}, limit 1" in reasons["concurrency_key"]


def test_a_sleeping_task_page_reads_its_checkpoints_once_and_explains_the_sleep(
    pgtask_engine: Engine, client_for: Callable[..., TestClient]
) -> None:
    # The page hands its newest step to explain rather than explain reading every checkpoint
    # of the task again (no index orders them by time: each read is a pass over all of them).
    wake = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "long.workflow", {}).id
        connection.execute(update(Task).where(Task.id == task_id).values(run_at=wake))
        for occurrence in range(3):
            connection.execute(insert(Checkpoint).values(
                task_id=task_id, version=1, step="step", occurrence=occurrence, kind="step",
                value={"i": occurrence},
                created_at=func.now() - timedelta(minutes=10 - occurrence),
            ))
        connection.execute(insert(Checkpoint).values(
            task_id=task_id, version=1, step="nap", occurrence=0, kind="sleep",
            value={"wake_at": wake.isoformat()}, created_at=func.now(),
        ))
    statements: list[str] = []

    def seen(*args: Any) -> None:
        statements.append(args[2])

    event.listen(pgtask_engine, "before_cursor_execute", seen)
    try:
        page = client_for().get(f"/tasks/{task_id}")
    finally:
        event.remove(pgtask_engine, "before_cursor_execute", seen)
    assert page.status_code == 200
    ordered = [s for s in statements
               if "FROM pgtask.checkpoints" in s and "created_at DESC" in s]
    assert len(ordered) == 1, ordered
    with pgtask_engine.connect() as connection:
        explanation = explain(connection, task_id)
    assert "sleeping" in {r.code for r in explanation.reasons}
    # Read a moment apart, "(in 59m 59s)" may have become "(in 59m 58s)": not compared.
    assert _absolute(reasons_on(page.text)) == _absolute(
        [(r.code, f"{r.code} {r.message}") for r in explanation.reasons]
    )


def _absolute(reasons: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The reasons without their "(in ...)" countdowns, which move with the clock."""
    return [(code, re.sub(r" \(in [^)]*\)", "", text)) for code, text in reasons]
