"""The task page's "Why is it in this state" section: `explain`'s reasons, each its code and
its sentence, the same as `explain` gives for that task in the same database, user data in the
sentences (an audit reason, an error message) as inert text."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from starlette.testclient import TestClient

from sqlalchemy_pgtask import explain
from tests.dashboard.conftest import Shared
from tests.dashboard.seed import XSS_ERROR
from tests.dashboard.test_task_detail_durable import section, task_page, text_of


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
