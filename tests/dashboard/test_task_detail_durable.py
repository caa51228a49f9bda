"""The task page of a durable task: its recorded steps (values escaped) and what it waits for
now (a signal, the end of a durable sleep, a child), and the family tree between a parent and
the child it waits for.

A real worker (`running_worker`) puts real tasks into each situation on the test's own
database; the worker is stopped before the pages are read (a waiting or sleeping task stays
as it is without one). Every assertion looks inside the part of the page that shows it (the
``data-testid`` of ``task.html``), so it fails if the template stops rendering that part.
"""

from __future__ import annotations

import html
import json
import re
import uuid
from collections.abc import Callable
from datetime import datetime
from html.parser import HTMLParser
from typing import Any, Final

from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.testclient import TestClient

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions
from sqlalchemy_pgtask.models import Task, Wait
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS: Final = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)

#: The value of the signal task's step: markup that must reach the page as text.
PREPARED: Final[dict[str, Any]] = {"note": "<b>x</b>", "ref": "INV-7f3a-prepared"}
ESCAPED_MARKUP: Final = "&lt;b&gt;x&lt;/b&gt;"
DRAFT: Final[dict[str, Any]] = {"draft": "REMINDER-51c9"}

REVIEW: Final = "invoice.review"
REMIND: Final = "invoice.remind"
ORDER: Final = "shipment.order"
LABEL: Final = "shipment.label"


def durable_registry() -> Registry:
    registry = Registry()

    @registry.task(REVIEW, max_attempts=1)
    async def review(ctx: TaskContext, payload: None) -> Any:
        prepared = await ctx.step("prepare-invoice", lambda: PREPARED)
        approval = await ctx.wait_for_signal("await-approval", "approval", timeout=3600)
        return [prepared, approval]

    @registry.task(REMIND, max_attempts=1)
    async def remind(ctx: TaskContext, payload: None) -> str:
        await ctx.step("draft-reminder", lambda: DRAFT)
        await ctx.sleep_for("cool-off", 3600)
        return "reminded"

    @registry.task(LABEL, max_attempts=1)
    async def label(ctx: TaskContext, payload: dict[str, int]) -> Any:
        return await ctx.wait_for_signal("await-pickup", "pickup")

    @registry.task(ORDER, max_attempts=1)
    async def order(ctx: TaskContext, payload: None) -> Any:
        child = await ctx.spawn("spawn-label", label, {"parcel": 1})
        return (await ctx.wait_for_result("await-label", child)).result

    return registry


# -- reading the page ------------------------------------------------------------------------


def section(page: str, testid: str) -> str:
    """The inner HTML of the element carrying ``data-testid=testid``; fails if there is none."""
    found = re.search(rf'<(\w+)\b[^>]*\bdata-testid="{testid}"[^>]*>(.*?)</\1>', page, re.S)
    assert found is not None, f'the page has no data-testid="{testid}"'
    return found.group(2)


def text_of(fragment: str) -> str:
    """What a reader sees of an HTML fragment: tags dropped, entities decoded, spaces folded."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


class _Rows(HTMLParser):
    """The rows of the table with a given ``data-testid``, each a dict from its column's
    header to the cell's text (entities decoded)."""

    def __init__(self, testid: str) -> None:
        super().__init__(convert_charrefs=True)
        self.testid = testid
        self.inside = False
        self.header: list[str] = []
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("data-testid", self.testid) in attrs:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if not self.inside:
            return
        if tag == "table":
            self.inside = False
        elif tag in ("td", "th") and self.cell is not None:
            value = "".join(self.cell).strip()
            (self.header if tag == "th" else self.rows[-1]).append(value)
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.inside and self.cell is not None:
            self.cell.append(data)


def table_rows(page: str, testid: str) -> list[dict[str, str]]:
    parser = _Rows(testid)
    parser.feed(page)
    parser.close()
    assert parser.header, f'the page has no table with data-testid="{testid}"'
    return [dict(zip(parser.header, row, strict=True)) for row in parser.rows if row]


def tree_items(page: str) -> list[tuple[str, str]]:
    """The family tree's items: (class, inner HTML)."""
    return re.findall(r'<li class="([^"]*)">(.*?)</li>', section(page, "tree"), re.S)


def links_to(fragment: str, task_id: uuid.UUID) -> bool:
    return f'href="/tasks/{task_id}"' in fragment


def stamps_after(word: str, fragment: str) -> list[datetime]:
    """The instants of the ``<time>`` elements right after ``word`` in a fragment."""
    return [
        datetime.fromisoformat(found)
        for found in re.findall(rf'\b{word}\s*<time datetime="([^"]+)"', fragment)
    ]


def task_page(client: TestClient, task_id: uuid.UUID) -> str:
    page = client.get(f"/tasks/{task_id}")
    assert page.status_code == 200, page.text
    return page.text


def only(rows: list[dict[str, str]], step: str) -> dict[str, str]:
    matching = [row for row in rows if row.get("Step") == step]
    assert len(matching) == 1, f"step {step!r} in {rows}"
    return matching[0]


# -- the tests -------------------------------------------------------------------------------


async def test_a_task_waiting_for_a_signal_shows_its_step_value_escaped_and_the_signal(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    client_for: Callable[..., TestClient],
) -> None:
    task_id = await add(pgtask_async_engine, REVIEW)
    async with running_worker(durable_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, ["waiting"], timeout=PATIENCE)
    with pgtask_engine.connect() as connection:
        deadline = connection.scalar(select(Wait.timeout_at).where(Wait.task_id == task_id))
    assert deadline is not None

    page = task_page(client_for(), task_id)

    # The steps table: the step's name, kind and stored value, the markup as inert text.
    step = only(table_rows(page, "steps"), "prepare-invoice")
    assert (step["#"], step["Kind"], step["Version"]) == ("0", "step", "1")
    assert json.loads(step["Value"]) == PREPARED
    steps = section(page, "steps")
    assert ESCAPED_MARKUP in steps
    assert "INV-7f3a-prepared" in steps
    assert "<b>x</b>" not in page
    # The wait: a signal, by name, at its step, with its timeout.
    wait = section(page, "wait")
    # "signal" once: the kind and the name used to each say it ("signal signal approval").
    assert text_of(wait).startswith("signal approval at step")
    assert "at step await-approval #0" in text_of(wait)
    assert stamps_after("until", wait) == [deadline]


async def test_a_task_in_a_durable_sleep_shows_its_sleep_step_and_its_wake_time(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    client_for: Callable[..., TestClient],
) -> None:
    task_id = await add(pgtask_async_engine, REMIND)

    async def asleep() -> bool:
        attempts = await attempt_rows(pgtask_async_engine, task_id)
        row = await task_row(pgtask_async_engine, task_id)
        return bool(attempts) and attempts[-1]["state"] == "suspended" and (
            row["state"] == "pending"
        )

    async with running_worker(durable_registry(), pgtask_database_url, OPTIONS):
        # A sleeping task is pending (until its wake time), not waiting: no wait row.
        await wait_until(asleep, PATIENCE, message=f"{task_id} suspended in its sleep")
    with pgtask_engine.connect() as connection:
        wake = connection.scalar(select(Task.run_at).where(Task.id == task_id))
        assert connection.scalar(select(Wait.task_id).where(Wait.task_id == task_id)) is None
    assert wake is not None

    page = task_page(client_for(), task_id)

    rows = table_rows(page, "steps")
    assert [row["Step"] for row in rows] == ["draft-reminder", "cool-off"]
    assert json.loads(only(rows, "draft-reminder")["Value"]) == DRAFT
    nap = only(rows, "cool-off")
    assert nap["Kind"] == "sleep"
    assert datetime.fromisoformat(json.loads(nap["Value"])["wake_at"]) == wake
    wait = section(page, "wait")
    assert text_of(wait).startswith("sleep")
    assert "at step cool-off #0" in text_of(wait)
    assert stamps_after("until", wait) == [wake]


async def test_a_parent_waiting_for_its_child_names_the_child_and_the_child_its_parent(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    client_for: Callable[..., TestClient],
) -> None:
    parent_id = await add(pgtask_async_engine, ORDER)
    async with running_worker(durable_registry(), pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, parent_id, ["waiting"], timeout=PATIENCE)
        with pgtask_engine.connect() as connection:
            children = list(connection.scalars(select(Task.id).where(Task.parent_id == parent_id)))
        assert len(children) == 1
        [child_id] = children
        await wait_for_state(pgtask_async_engine, child_id, ["waiting"], timeout=PATIENCE)
    client = client_for()

    parent = task_page(client, parent_id)
    child = task_page(client, child_id)

    # The parent: its spawn step holds the child's id; it waits for that child.
    spawned = only(table_rows(parent, "steps"), "spawn-label")
    assert spawned["Kind"] == "spawn"
    assert json.loads(spawned["Value"]) == {"task_id": str(child_id)}
    wait = section(parent, "wait")
    assert text_of(wait).startswith(f"child {child_id} at step")
    assert links_to(wait, child_id)
    assert "at step await-label #0" in text_of(wait)
    descendants = [inner for kind, inner in tree_items(parent) if "descendant" in kind.split()]
    assert len(descendants) == 1
    assert links_to(descendants[0], child_id)
    assert LABEL in text_of(descendants[0])
    assert not any("ancestor" in kind.split() for kind, _ in tree_items(parent))
    # The child: its parent is its one ancestor; it waits for its own signal.
    ancestors = [inner for kind, inner in tree_items(child) if "ancestor" in kind.split()]
    assert len(ancestors) == 1
    assert links_to(ancestors[0], parent_id)
    assert ORDER in text_of(ancestors[0])
    assert text_of(section(child, "wait")).startswith("signal pickup at step")
