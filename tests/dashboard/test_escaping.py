"""User data beyond payloads and errors renders inert on every page that shows it:
idempotency keys, headers, results, step names and values, audit actors and reasons (given
to the library, to the dashboard's own forms, or by the host's auth hook), schedule payloads,
headers and errors, worker hostnames and versions, and input echoed by error pages.

The pages send a Content-Security-Policy that forbids inline script, so whether markup would
*run* in a browser proves nothing here: each page is parsed with `html.parser`, and must hold
no ``script`` element (the dashboard has no script of its own; one from its static files would
be allowed), no ``img``, no other embedding element, no ``on*`` attribute and no
``javascript:`` URL, while the value shows, escaped, as the text of the element meant for it.
Names of tasks, queues and schedules match a strict ASCII pattern (`validation.NAME_PATTERN`),
so they cannot hold markup and are not tried.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from html.parser import HTMLParser
from typing import Final
from urllib.parse import quote

import httpx2
import pytest
from sqlalchemy import Engine, create_engine, func, insert, select, text, update
from starlette.requests import Request
from starlette.testclient import TestClient

from sqlalchemy_pgtask import (
    cancel,
    configure_queue,
    enqueue,
    materialize_schedules,
    pause_queue,
    retry,
    set_schedule,
)
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.models import Checkpoint, Schedule, Task, WorkerRecord
from sqlalchemy_pgtask.schedule import pause_schedule
from sqlalchemy_pgtask.testing import ServerInfo, create_database, drop_database
from tests.dashboard.conftest import TOKEN
from tests.dashboard.seed import succeed_task


def markup(n: int) -> str:
    """Markup that would run script (``window.__xss = n``) if a page failed to escape it."""
    return f'<script>window.__xss={n}</script><img src=x onerror="window.__xss={n}">'


KEY: Final = "order " + markup(1)
HEADER: Final = markup(2)
RESULT: Final = markup(3)
STEP: Final = "charge " + markup(4)
STEP_VALUE: Final = markup(5)
ACTOR: Final = "ops " + markup(6)
TASK_REASON: Final = "smtp " + markup(7)
QUEUE_REASON: Final = "freeze " + markup(8)
SCHEDULE_PAYLOAD: Final = markup(9)
SCHEDULE_HEADER: Final = markup(10)
SCHEDULE_ERROR: Final = "materialise failed: " + markup(11)
SCHEDULE_REASON: Final = "holiday " + markup(12)
HOSTNAME: Final = markup(13)
WORKER_VERSION: Final = markup(14)
FORM_REASON: Final = "from the form " + markup(15)
HOOK_ACTOR: Final = "app:" + markup(16)
HOOK_REASON: Final = "from the hook " + markup(17)
#: For messages that echo only the first 20 characters of the input.
SHORT: Final = "<img src=x><script>"
#: For a path segment: no slash.
NO_SLASH: Final = '<img src=x onerror="window.__xss=18">'
ESCAPED: Final = "&lt;script&gt;window.__xss="
SCHEDULE: Final = "markup-schedule"


def as_json(value: str) -> str:
    """How `pretty` (json.dumps, non-ASCII kept) writes a string: quotes escaped."""
    return json.dumps(value, ensure_ascii=False)


# -- the checker --------------------------------------------------------------------------

#: Elements that never hold text (html.parser reports no end tag for them).
VOID: Final = frozenset({
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
    "track", "wbr",
})
#: Elements that load or embed something: none may come from data.
EMBEDDING: Final = frozenset({"img", "iframe", "object", "embed", "svg", "math", "base", "frame"})
#: The classes of the dashboard's own drawings: an ``svg`` carrying one is the template's,
#: not data (the data inside it, step names, signal names, errors, is checked as text).
OWN_DRAWINGS: Final = frozenset({"timeline"})
CHART_KINDS: Final = frozenset({"finished", "failed", "depth"})


@dataclass
class Element:
    tag: str
    attrs: dict[str, str | None]
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """Its text content (descendants included), character references decoded."""
        return "".join(self.parts)


class Elements(HTMLParser):
    """Every start tag of a page, in order, each with its attributes and text."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[Element] = []
        self._open: list[Element] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, dict(attrs))
        self.found.append(element)
        if tag not in VOID:
            self._open.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append(Element(tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        for index in range(len(self._open) - 1, -1, -1):
            if self._open[index].tag == tag:
                del self._open[index:]
                return

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element.parts.append(data)

    def all(self, tag: str, **attrs: str) -> list[Element]:
        """The ``tag`` elements whose attributes include ``attrs`` (``class_`` for class;
        a class matches one of the element's classes)."""
        wanted = {k.rstrip("_"): v for k, v in attrs.items()}
        return [
            e for e in self.found if e.tag == tag and all(
                v in (e.attrs.get(k) or "").split() if k == "class" else e.attrs.get(k) == v
                for k, v in wanted.items()
            )
        ]

    def one(self, tag: str, **attrs: str) -> Element:
        (element,) = self.all(tag, **attrs)
        return element


def own_chart(element: Element) -> bool:
    """The overview's charts (`dashboard._charts`): an ``svg`` of a fixed class and kind,
    drawn from numbers; an event handler on one is still reported."""
    return (element.tag == "svg" and element.attrs.get("data-chart") in CHART_KINDS
            and element.attrs.get("class") == f"chart chart-{element.attrs.get('data-chart')}")


def active_markup(page: str) -> list[str]:
    """What in ``page`` would run or load something: script elements (but the dashboard's
    own, from its static files), embedding elements, event handler attributes, javascript:
    URLs."""
    found = []
    for element in Elements(page).found:
        src = element.attrs.get("src") or ""
        if element.tag == "script" and not src.startswith("/static/"):
            found.append(f"<script src={src!r}>")
        own = element.tag == "svg" and not OWN_DRAWINGS.isdisjoint(
            (element.attrs.get("class") or "").split()
        )
        if element.tag in EMBEDDING and not own and not own_chart(element):
            found.append(f"<{element.tag}>")
        for name, value in element.attrs.items():
            if name.startswith("on"):
                found.append(f"<{element.tag} {name}=...>")
            if (value or "").strip().lower().startswith("javascript:"):
                found.append(f"<{element.tag} {name}=javascript:...>")
    return found


def inert(answer: httpx2.Response) -> Elements:
    """The page's elements, after checking that it answered, holds no active markup, and
    shows escaped markup somewhere."""
    assert answer.status_code == 200
    assert active_markup(answer.text) == []
    assert ESCAPED in answer.text
    return Elements(answer.text)


def test_the_checker_finds_markup_that_was_not_escaped() -> None:
    """The control of every test below: unescaped, the same values are found."""
    page = (
        f"<html><body><p>{HEADER}</p><a href='javascript:alert(1)'>x</a>"
        f"<svg onload=alert(1)></svg><script src='/static/dashboard.js'></script></body></html>"
    )
    assert active_markup(page) == [
        "<script src=''>", "<img>", "<img onerror=...>", "<a href=javascript:...>", "<svg>",
        "<svg onload=...>",
    ]
    parsed = Elements(f"<dl><dd><code>{KEY.replace('<', '&lt;')}</code></dd></dl>")
    assert parsed.one("code").text == KEY
    assert active_markup(f"<pre>{as_json(HEADER).replace('<', '&lt;')}</pre>") == []


# -- the database -------------------------------------------------------------------------


@dataclass(frozen=True)
class Marked:
    engine: Engine
    #: Its key, headers, result, step, and audit entries carry markup.
    task: uuid.UUID
    #: Created by the schedule, whose payload and headers carry markup.
    scheduled: uuid.UUID
    #: Cancelled through the dashboard's form, with a reason in markup.
    cancelled: uuid.UUID


def hook_actor(request: Request) -> str | None:
    """The host application's auth, which names its user with markup."""
    return HOOK_ACTOR


def _fill(engine: Engine) -> Marked:
    with engine.begin() as connection:
        configure_queue(connection, "emails", actor="seed")
        task = enqueue(connection, "emails.send", {"to": "a@example.com"}, queue="emails",
                       idempotency_key=KEY, headers={"trace": HEADER}).id
        cancel(connection, task, actor=ACTOR, reason=TASK_REASON)
        retry(connection, task, actor=ACTOR, reason=TASK_REASON)
        # What only a worker writes: the result, and a checkpoint of a durable step.
        succeed_task(connection, task, {"echo": RESULT})
        connection.execute(insert(Checkpoint).values(
            task_id=task, version=1, step=STEP, occurrence=0, kind="step",
            value={"charged": STEP_VALUE},
        ))
        pause_queue(connection, "emails", actor=ACTOR, reason=QUEUE_REASON)
        cancelled = enqueue(connection, "orders.ship", {"order": 7}).id

        now = connection.scalar(select(func.now()))
        assert now is not None
        set_schedule(connection, SCHEDULE, task="reports.build", every=3600, queue="reports",
                     payload={"kind": SCHEDULE_PAYLOAD}, headers={"h": SCHEDULE_HEADER},
                     start_at=now - timedelta(hours=2), actor=ACTOR)
        materialize_schedules(connection)
        scheduled = connection.scalar(select(Task.id).where(Task.schedule_name == SCHEDULE))
        assert scheduled is not None
        # What only the materialiser writes: why its latest run failed.
        connection.execute(
            update(Schedule).where(Schedule.name == SCHEDULE).values(last_error=SCHEDULE_ERROR)
        )
        pause_schedule(connection, SCHEDULE, actor=ACTOR, reason=SCHEDULE_REASON)
        # What only a worker writes: its registration.
        connection.execute(insert(WorkerRecord).values(
            id=uuid.uuid4(), queues=["emails"], version=WORKER_VERSION, hostname=HOSTNAME,
            pid=7, concurrency=1, expires_at=text("now() + interval '1 hour'"),
        ))

    # Through the dashboard's own authorised actions: a reason typed into its form ...
    with TestClient(create_app(engine, admin_token=TOKEN), follow_redirects=False) as client:
        client.get("/login")
        csrf = client.cookies["pgtask_csrf"]
        logged_in = client.post("/login", data={"csrf_token": csrf, "token": TOKEN})
        assert logged_in.status_code == 303
        csrf = client.cookies["pgtask_csrf"]  # the login's own, fresh token
        answer = client.post(f"/tasks/{cancelled}/cancel",
                             data={"csrf_token": csrf, "reason": FORM_REASON})
        assert answer.status_code == 303
    # ... and an actor named by the host application's auth hook.
    app = create_app(engine, actor_from_request=hook_actor)
    with TestClient(app, follow_redirects=False) as client:
        client.get("/")
        answer = client.post("/queues/reports/pause", data={
            "csrf_token": client.cookies["pgtask_csrf"], "reason": HOOK_REASON,
        })
        assert answer.status_code == 303
    return Marked(engine, task, scheduled, cancelled)


@pytest.fixture(scope="module")
def marked(pgtask_server: ServerInfo, pgtask_template_database: str) -> Iterator[Marked]:
    """One database for the module, holding markup wherever user data may go (the tests
    only read it)."""
    url = create_database(pgtask_server.url, "pgtask_markup", template=pgtask_template_database)
    engine = create_engine(url)
    try:
        yield _fill(engine)
    finally:
        engine.dispose()
        drop_database(url)


@pytest.fixture(scope="module")
def client(marked: Marked) -> Iterator[TestClient]:
    """The dashboard, logged in with the token (so every button shows as well)."""
    with TestClient(create_app(marked.engine, admin_token=TOKEN)) as client:
        client.get("/login")
        client.post("/login", data={
            "csrf_token": client.cookies["pgtask_csrf"], "token": TOKEN, "name": "carol",
        })
        assert "dashboard:carol" in client.get("/").text
        yield client


# -- the pages ----------------------------------------------------------------------------


def test_a_task_found_by_its_markup_idempotency_key_is_listed_and_the_key_echoed_inert(
    client: TestClient, marked: Marked
) -> None:
    page = inert(client.get("/tasks", params={"q": KEY}))

    listed = [row.attrs["data-task-id"] for row in page.all("tr") if "data-task-id" in row.attrs]
    assert listed == [str(marked.task)]
    # In the filter form and in the bulk actions' hidden fields, it stayed inside the attribute.
    assert [i.attrs["value"] for i in page.all("input", name="q")] == [KEY] * 3


def test_the_task_page_shows_key_headers_result_step_and_audit_as_text(
    client: TestClient, marked: Marked
) -> None:
    answer = client.get(f"/tasks/{marked.task}")
    page = inert(answer)

    assert KEY in [code.text for code in page.all("code")]
    (headers,) = [pre for pre in page.all("pre", class_="json") if "trace" in pre.text]
    assert as_json(HEADER) in headers.text
    assert as_json(RESULT) in page.one("pre", **{"data-testid": "result"}).text
    steps = page.one("table", **{"data-testid": "steps"})
    assert STEP in [code.text for code in page.all("code")]
    assert as_json(STEP_VALUE) in steps.text
    audit = page.one("table", **{"data-testid": "task-audit"}).text
    assert audit.count(ACTOR) == 2  # retried and cancelled
    assert audit.count(TASK_REASON) == 2
    assert "&lt;img src=x onerror=&#34;window.__xss=1&#34;&gt;" in answer.text


def test_a_scheduled_task_shows_the_schedule_payload_and_headers_as_text(
    client: TestClient, marked: Marked
) -> None:
    page = inert(client.get(f"/tasks/{marked.scheduled}"))

    assert as_json(SCHEDULE_PAYLOAD) in page.one("pre", **{"data-testid": "payload"}).text
    assert any(as_json(SCHEDULE_HEADER) in pre.text for pre in page.all("pre", class_="json"))


def test_the_schedules_page_shows_the_last_error_as_text(client: TestClient) -> None:
    page = inert(client.get("/schedules"))

    assert page.one("p", class_="error").text == SCHEDULE_ERROR


def test_the_audit_log_shows_every_actor_and_reason_as_text(client: TestClient) -> None:
    page = inert(client.get("/audit"))

    actors = [cell.text for cell in page.all("td", class_="actor")]
    assert actors.count(ACTOR) == 5  # cancel, retry, pause, schedule set and pause
    assert actors.count(HOOK_ACTOR) == 1
    cells = [cell.text for cell in page.all("td")]
    for reason in (TASK_REASON, QUEUE_REASON, SCHEDULE_REASON, FORM_REASON, HOOK_REASON):
        assert reason in cells, reason


def test_the_workers_page_shows_hostname_and_version_as_text(client: TestClient) -> None:
    page = inert(client.get("/workers"))

    (card,) = page.all("section", class_="card")
    assert HOSTNAME in card.text
    assert f"version {WORKER_VERSION}" in card.text


PAGES: Final[dict[str, Callable[[Marked], str]]] = {
    "overview": lambda m: "/",
    "tasks": lambda m: "/tasks",
    "task": lambda m: f"/tasks/{m.task}",
    "scheduled-task": lambda m: f"/tasks/{m.scheduled}",
    "cancelled-task": lambda m: f"/tasks/{m.cancelled}",
    "workers": lambda m: "/workers",
    "schedules": lambda m: "/schedules",
    "audit": lambda m: "/audit",
    "login": lambda m: "/login",
}


@pytest.mark.parametrize("name", PAGES)
def test_a_markup_actor_from_the_host_hook_shows_as_text_on_every_page(
    marked: Marked, name: str
) -> None:
    with TestClient(create_app(marked.engine, actor_from_request=hook_actor)) as client:
        page = inert(client.get(PAGES[name](marked)))

    assert page.one("span", **{"data-testid": "actor"}).text == HOOK_ACTOR


#: Input an error page repeats: (path, query, the part of the input the message shows).
ECHOED: Final[dict[str, tuple[str, dict[str, str], str]]] = {
    "task-list-state": ("/tasks", {"state": markup(20)}, markup(20)),
    "task-list-queue": ("/tasks", {"queue": markup(21)}, markup(21)),
    "task-list-name": ("/tasks", {"name": markup(22)}, markup(22)),
    "task-list-since": ("/tasks", {"since": SHORT}, SHORT),
    "task-list-until": ("/tasks", {"until": SHORT}, SHORT),
    "task-list-cursor": ("/tasks", {"after": SHORT}, SHORT),
    "task-list-limit": ("/tasks", {"limit": SHORT}, SHORT),
    "audit-task": ("/audit", {"task": markup(23)}, markup(23)),
    "audit-queue": ("/audit", {"queue": markup(24)}, markup(24)),
    "audit-before": ("/audit", {"before": SHORT}, SHORT),
    "audit-limit": ("/audit", {"limit": SHORT}, SHORT),
    "task-id-in-the-path": (f"/tasks/{quote(NO_SLASH)}", {}, NO_SLASH),
}


@pytest.mark.parametrize("case", ECHOED)
def test_an_error_page_shows_the_input_it_echoes_as_text(client: TestClient, case: str) -> None:
    path, query, echoed = ECHOED[case]

    answer = client.get(path, params=query)
    assert answer.status_code == 400
    assert active_markup(answer.text) == []
    message = Elements(answer.text).one("p", **{"data-testid": "error"}).text

    assert echoed in message
    assert "&lt;img src=x" in answer.text


def test_a_refused_action_on_a_markup_queue_name_shows_it_as_text(client: TestClient) -> None:
    answer = client.post(f"/queues/{quote(NO_SLASH)}/pause",
                         data={"csrf_token": client.cookies["pgtask_csrf"]})

    assert answer.status_code == 400
    assert active_markup(answer.text) == []
    assert NO_SLASH in Elements(answer.text).one("p", **{"data-testid": "error"}).text


def test_a_notice_parameter_in_markup_is_not_shown(client: TestClient) -> None:
    answer = client.get("/", params={"notice": markup(25)})

    assert answer.status_code == 200
    assert active_markup(answer.text) == []
    assert "__xss=25" not in answer.text
    assert Elements(answer.text).all("p", class_="notice") == []
