"""The task page's timeline, over HTTP on a real database: a workflow's attempts, steps,
sleep, waits (child, signal) and child on one axis, why each attempt ended, user data as inert
text, and a workflow far longer than the page shows read in bounded pieces.

The workflow is `tests.dashboard.workflow`'s, run by a real worker; the long one is written
with plain inserts (300 checkpoints), since only the page's bound is under test there.
"""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Engine, event, func, insert, select, update
from starlette.testclient import TestClient

from sqlalchemy_pgtask import enqueue, status
from sqlalchemy_pgtask.dashboard._timeline import TIMELINE_LIMIT
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import Attempt, Checkpoint, Task
from tests.dashboard.test_escaping import Elements, active_markup
from tests.dashboard.test_task_detail_durable import section, table_rows, task_page, text_of
from tests.dashboard.workflow import BOOM, RESERVE, Workflow, run_workflow


@pytest.fixture
def workflow(pgtask_database_url: str, pgtask_engine: Engine) -> Workflow:
    return run_workflow(pgtask_database_url, pgtask_engine)


def endings(page: str) -> list[tuple[str, str, str]]:
    """(attempt, state, sentence) of each attempt the timeline explains."""
    return [
        (attempt, state, text_of(inner))
        for attempt, state, inner in re.findall(
            r'<li data-attempt="(\d+)" data-state="([a-z]+)">(.*?)</li>',
            section(page, "attempt-endings"), re.S,
        )
    ]


def shapes(page: str, css: str) -> list[str]:
    """The tooltips of the drawing's shapes carrying class ``css``."""
    drawing = Elements(section(page, "timeline"))
    found = [*drawing.all("rect", class_=css), *drawing.all("circle", class_=css)]
    return [element.text for element in found]


def test_the_timeline_draws_every_part_of_a_workflow_and_says_why_each_attempt_ended(
    workflow: Workflow, client_for: Callable[..., TestClient]
) -> None:
    page = task_page(client_for(), workflow.parent)

    said = endings(page)
    assert [(attempt, state) for attempt, state, _ in said] == [
        ("1", "failed"), ("2", "suspended"), ("3", "suspended"), ("4", "suspended"),
    ]
    assert said[0][2] == f"Attempt 1 failed with tests.dashboard.workflow.SeatTaken: {BOOM}"
    assert "Attempt 2 suspended for a sleep at step cool-off #0 until" in said[1][2]
    assert f"suspended waited for child {workflow.child} at step await-hotel" in said[2][2]
    assert "which ended succeeded" in said[2][2]
    assert "Attempt 4 suspended waiting for signal approval at step await-approval #0" in said[3][2]
    assert f'href="/tasks/{workflow.child}"' in section(page, "attempt-endings")
    # The drawing: one bar per attempt in its state, a mark per step of its kind, the sleep
    # and both waits as bars, and the child as a bar linking to its page.
    assert len(shapes(page, "tl-attempt")) == 4
    assert len(shapes(page, "tl-failed")) == 1
    assert len(shapes(page, "tl-suspended")) == 3
    kinds = {kind: len(shapes(page, f"tl-kind-{kind}")) for kind in (
        "step", "sleep", "spawn", "result", "signal",
    )}
    assert kinds == {"step": 1, "sleep": 1, "spawn": 1, "result": 1, "signal": 0}
    assert shapes(page, "tl-sleep") == [
        t for t in shapes(page, "tl-wait") if t.startswith("sleep cool-off until")
    ]
    assert len(shapes(page, "tl-wait-child")) == 1
    assert len(shapes(page, "tl-wait-signal")) == 1
    assert shapes(page, "tl-child") == ["child trip.hotel succeeded"]
    drawing = section(page, "timeline")
    assert f'<a href="/tasks/{workflow.child}"><rect class="tl-bar tl-child' in drawing
    # User data is text: the step name in its tooltip, the error in the drawing and the list.
    assert f"step {RESERVE} #0 at" in " ".join(shapes(page, "tl-kind-step"))
    assert html.escape(RESERVE, quote=False) in drawing
    assert html.escape(BOOM, quote=False) in section(page, "attempt-endings")
    assert active_markup(page) == []
    assert "<i>seat</i>" not in page
    assert "<b>no seat</b>" not in page


def test_the_child_explains_its_signal_wait_by_the_signals_name(
    workflow: Workflow, client_for: Callable[..., TestClient]
) -> None:
    page = task_page(client_for(), workflow.child)

    said = endings(page)
    assert [(attempt, state) for attempt, state, _ in said] == [
        ("1", "suspended"), ("2", "succeeded"),
    ]
    assert "Attempt 1 suspended waited for signal go at step await-go, received at" in said[0][2]
    assert len(shapes(page, "tl-kind-signal")) == 1
    assert len(shapes(page, "tl-wait-signal")) == 1


def test_a_workflow_longer_than_the_page_shows_its_newest_parts_and_counts_the_rest(
    pgtask_engine: Engine, client_for: Callable[..., TestClient]
) -> None:
    steps = TIMELINE_LIMIT + 100
    with pgtask_engine.begin() as connection:
        task_id = enqueue(connection, "long.workflow").id
        connection.execute(insert(Checkpoint), [
            {"task_id": task_id, "version": 1, "step": "tick", "occurrence": n, "kind": "step",
             "value": n}
            for n in range(steps)
        ])
        connection.execute(insert(Attempt).values(finished_at=func.now()), [
            {"task_id": task_id, "attempt": n, "lease_token": uuid.uuid4(), "state": "released"}
            for n in range(1, TIMELINE_LIMIT + 51)
        ])
        # Created long before: the axis must start at the oldest part shown, not there.
        connection.execute(update(Task).where(Task.id == task_id).values(
            created_at=func.now() - timedelta(days=30)
        ))

    page = task_page(client_for(), task_id)

    assert len(shapes(page, "tl-kind-step")) == TIMELINE_LIMIT
    caption = text_of(section(page, "timeline"))
    assert "100 older steps are not shown" in caption
    assert "50 older attempts are not shown" in caption
    assert len(shapes(page, "tl-attempt")) == TIMELINE_LIMIT
    assert endings(page)[0][0] == "51"
    assert endings(page)[0][2].startswith("Attempt 51 released handed back to the queue")
    [start, *_] = re.findall(r'<time datetime="([^"]+)"', section(page, "timeline"))
    with pgtask_engine.connect() as connection:
        created = connection.scalar(select(Task.created_at).where(Task.id == task_id))
    assert created is not None
    assert datetime.fromisoformat(start) > created + timedelta(days=29)
    rows = table_rows(page, "steps")
    # Inserted in one statement, all share one instant: the newest are the last by name and
    # occurrence, the tie-break of the order.
    assert [row["#"] for row in rows] == [str(n) for n in range(100, steps)]


def test_task_detail_refuses_a_limit_out_of_range_before_any_sql(pgtask_engine: Engine) -> None:
    statements: list[str] = []
    with pgtask_engine.connect() as connection:
        event.listen(connection, "before_cursor_execute", lambda *args: statements.append(args[2]))
        for limit in (0, status.LIST_LIMIT_MAX + 1, True):
            with pytest.raises(InvalidOptionError):
                status.task_detail(connection, uuid.uuid4(), steps_limit=limit)
            with pytest.raises(InvalidOptionError):
                status.task_detail(connection, uuid.uuid4(), attempts_limit=limit)
            with pytest.raises(InvalidOptionError):
                status.task_detail(connection, uuid.uuid4(), children_limit=limit)
    assert statements == []
