"""dashboard._queries: what the dashboard reads beyond `sqlalchemy_pgtask.status`; never writes.

Two reads are the dashboard's own: the task list, whose filters (a time range, a search by id
or idempotency key), keyset cursor and bounded reads go beyond `status.list_tasks`, and the
last hour's throughput per queue. Everything else (counts by state, one task in detail, workers,
schedules, the audit log) comes from the library's read models, so the dashboard and the
``pgtask`` command cannot disagree.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Connection, func, literal, literal_column, select, tuple_
from sqlalchemy.orm import aliased

from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import IdempotencyKey, Task, WorkerCapability
from sqlalchemy_pgtask.statements import NOW
from sqlalchemy_pgtask.states import FAILED, RUNNING, SUCCEEDED, TERMINAL_STATES, TaskState
from sqlalchemy_pgtask.status import TaskDetail, TaskRef, TaskSummary, check_list_filters
from sqlalchemy_pgtask.validation import check_free_text

__all__ = [
    "PAGE_SIZE_MAX",
    "SCAN_LIMIT",
    "RunningTask",
    "TaskFilters",
    "TaskPage",
    "TaskTree",
    "Throughput",
    "capabilities",
    "parse_cursor",
    "running_tasks",
    "task_page",
    "task_tree",
    "throughput",
]

PAGE_SIZE_MAX: Final = 500
#: The most tasks one page of a filtered task list reads before it answers with what it found
#: (`TaskPage.searched_to`): about 20 ms of PostgreSQL on a small host, so a filter that
#: matches nothing answers in bounded time, whatever the size of the history.
SCAN_LIMIT: Final = 25_000
#: The longest search text: an idempotency key's limit.
_SEARCH_MAX_BYTES: Final = 512
#: The most running tasks the workers page lists.
_RUNNING_MAX: Final = 500

_SUMMARY_COLUMNS: Final = (
    Task.id, Task.queue, Task.name, Task.version, Task.state, Task.priority, Task.attempt,
    Task.max_attempts, Task.run_at, Task.created_at, Task.updated_at, Task.completed_at,
)
_SUMMARY_KEYS: Final = tuple(column.key for column in _SUMMARY_COLUMNS)


@dataclass(frozen=True)
class TaskFilters:
    """The task list's filters, checked: every field None means "any"."""

    state: TaskState | None = None
    queue: str | None = None
    name: str | None = None
    #: Created at or after this instant.
    since: datetime | None = None
    #: Created before this instant.
    until: datetime | None = None
    #: A task id, or an idempotency key (exact).
    search: str | None = None

    def __post_init__(self) -> None:
        check_list_filters(state=self.state, queue=self.queue, name=self.name)
        for field in ("since", "until"):
            value = getattr(self, field)
            if value is not None and value.tzinfo is None:
                raise InvalidOptionError(field, "must be an aware datetime")
        if self.search is not None:
            check_free_text("search", self.search, _SEARCH_MAX_BYTES)


@dataclass(frozen=True)
class TaskPage:
    """One page of the task list, newest first, and the cursor of the next (older) page."""

    tasks: tuple[TaskSummary, ...]
    #: Pass as ``after`` for the next page; None on the last page.
    next_cursor: str | None
    #: Set when the page stopped at `SCAN_LIMIT` tasks read before it found a full page: the
    #: creation time of the oldest task it read. Older tasks may match; ``next_cursor``
    #: continues the search below it.
    searched_to: datetime | None = None


@dataclass(frozen=True)
class Throughput:
    """Tasks of one queue that finished in the last hour."""

    queue: str
    succeeded: int
    failed: int
    cancelled: int

    @property
    def failure_rate(self) -> float | None:
        """Failed among succeeded + failed, 0 to 1; None when none of either finished."""
        done = self.succeeded + self.failed
        return None if done == 0 else self.failed / done


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND: Final = timedelta(microseconds=1)


def _cursor(created_at: datetime, task_id: uuid.UUID) -> str:
    """The keyset position of a task: its creation time (exact, in microseconds) and id."""
    return f"{(created_at - _EPOCH) // _MICROSECOND}.{task_id}"


def parse_cursor(value: str) -> tuple[datetime, uuid.UUID] | uuid.UUID:
    """A cursor made by `task_page` as ``(created_at, id)``, or a bare task id (the cursor of
    earlier versions, and a handy one to type: the list continues below that task); else
    `InvalidOptionError`."""
    micros, dot, rest = value.partition(".")
    try:
        if not dot:
            return uuid.UUID(value)
        if not micros.lstrip("-").isdigit():
            raise ValueError(micros)
        return _EPOCH + int(micros) * _MICROSECOND, uuid.UUID(rest)
    except (ValueError, OverflowError) as exc:
        raise InvalidOptionError("after", f"not a task list cursor: {value[:80]!r}") from exc


def _position(connection: Connection, after: str) -> tuple[datetime, uuid.UUID]:
    cursor = parse_cursor(after)
    if not isinstance(cursor, uuid.UUID):
        return cursor
    created = connection.execute(select(Task.created_at).where(Task.id == cursor)).scalar()
    if created is None:
        raise InvalidOptionError("after", f"no task with id {cursor} to continue below")
    return created, cursor


def _search(text: str, queue: str | None) -> Any:
    """A task id matches its task (primary key); other text matches an idempotency key
    through ``pgtask.idempotency_keys``, whose primary key ``(queue, key)`` makes it one
    lookup when the queue is known (without it, the keys are scanned). A key whose
    reservation retention already deleted is not found."""
    try:
        return Task.id == uuid.UUID(text)
    except ValueError:
        keys = select(IdempotencyKey.task_id).where(IdempotencyKey.key == text)
        if queue is not None:
            keys = keys.where(IdempotencyKey.queue == queue)
        return Task.id.in_(keys)


def task_page(
    connection: Connection,
    filters: TaskFilters,
    *,
    limit: int = 50,
    after: str | None = None,
    scan_limit: int = SCAN_LIMIT,
) -> TaskPage:
    """The newest tasks matching ``filters``, by creation (``created_at DESC, id DESC``),
    ``limit`` at most.

    The index on ``(created_at, id)`` serves the order and the time range: the scan walks it
    backwards from the cursor (or ``until``) and stops after ``limit + 1`` matches, without
    sorting the matching rows, so the cost of a page does not grow with its depth. A filter
    on state, queue or name is checked on each task read, and a page reads at most
    ``scan_limit`` tasks: a filter that matches few or none of them answers with what it
    found, `TaskPage.searched_to` says how far back it looked, and ``next_cursor`` goes on
    from there. A search by task id or idempotency key reads just those tasks.

    ``after`` is the previous page's `TaskPage.next_cursor`: the next page starts below that
    position, so rows added meanwhile never shift it, and no row is read twice or skipped.
    """
    if not 1 <= limit <= PAGE_SIZE_MAX:
        raise InvalidOptionError("limit", f"must be 1 to {PAGE_SIZE_MAX}, got {limit}")
    if scan_limit < 1:
        raise InvalidOptionError("scan_limit", f"must be at least 1, got {scan_limit}")
    bounds = []
    if filters.since is not None:
        bounds.append(Task.created_at >= filters.since)
    if filters.until is not None:
        bounds.append(Task.created_at < filters.until)
    if after is not None:
        created_at, task_id = _position(connection, after)
        bounds.append(tuple_(Task.created_at, Task.id) < tuple_(created_at, task_id))
    filtered = [
        (column, value) for column, value in (
            ("state", filters.state), ("queue", filters.queue), ("name", filters.name)
        ) if value is not None
    ]
    newest = (Task.created_at.desc(), Task.id.desc())
    if filters.search is not None or not filtered:
        # Every row the range yields is a match, or the search names the few rows to read.
        checks = [Task.__table__.c[column] == value for column, value in filtered]
        if filters.search is not None:
            checks.append(_search(filters.search, filters.queue))
        rows = connection.execute(
            select(*_SUMMARY_COLUMNS).where(*bounds, *checks).order_by(*newest)
            .limit(limit + 1)
        ).all()
        return _page([_summary(row) for row in rows], limit)
    # The filters apply to a bounded read, a subquery with its own LIMIT, which PostgreSQL
    # never pushes a condition into: the planner cannot trade the ordered index walk for a
    # scan of the whole table (it did, for a filter it thought rare), and the walk stops after
    # ``scan_limit`` rows.
    read = (
        select(*_SUMMARY_COLUMNS).where(*bounds).order_by(*newest).limit(scan_limit)
        .subquery("read")
    )
    rows = connection.execute(
        select(read)
        .where(*(read.c[column] == value for column, value in filtered))
        .order_by(read.c.created_at.desc(), read.c.id.desc())
        .limit(limit + 1)
    ).all()
    hits = [_summary(row) for row in rows]
    if len(hits) > limit:
        return _page(hits, limit)
    # Short of a page: either the range ended, or the read stopped at its limit. The last row
    # it read, if it read that many, is where the next page goes on (an index-only walk of the
    # same range: a few milliseconds, against ten times that for numbering every row read).
    last = connection.execute(
        select(Task.created_at, Task.id).where(*bounds).order_by(*newest)
        .offset(scan_limit - 1).limit(1)
    ).first()
    if last is None:
        return _page(hits, limit)
    return TaskPage(
        tasks=tuple(hits),
        next_cursor=_cursor(last.created_at, last.id),
        searched_to=last.created_at,
    )


def _summary(row: Any) -> TaskSummary:
    return TaskSummary(**{key: getattr(row, key) for key in _SUMMARY_KEYS})


def _page(found: list[TaskSummary], limit: int) -> TaskPage:
    """A page of the first ``limit`` of ``found`` (read ``limit + 1``: one more means an
    older page exists)."""
    tasks = tuple(found[:limit])
    more = len(found) > limit
    return TaskPage(
        tasks=tasks,
        next_cursor=_cursor(tasks[-1].created_at, tasks[-1].id) if more else None,
    )


def throughput(connection: Connection, *, window: timedelta = timedelta(hours=1)) -> dict[
    str, Throughput
]:
    """Per queue, the tasks that finished within ``window`` of database now.

    ``state IN`` the terminal states is written with literals so the partial index on finished
    tasks (``queue, completed_at, state``) serves it: the statement reads the window's rows
    from the index only, never the whole table.
    """
    terminal = Task.state.in_([literal_column(f"'{state}'") for state in TERMINAL_STATES])
    rows = connection.execute(
        select(Task.queue, Task.state, func.count().label("n"))
        .where(terminal, Task.completed_at >= NOW - window)
        .group_by(Task.queue, Task.state)
    ).all()
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        counts.setdefault(row.queue, {})[row.state] = row.n
    return {
        queue: Throughput(
            queue=queue,
            succeeded=by_state.get(SUCCEEDED, 0),
            failed=by_state.get(FAILED, 0),
            cancelled=by_state.get("cancelled", 0),
        )
        for queue, by_state in counts.items()
    }


@dataclass(frozen=True)
class RunningTask:
    """A task a worker holds the lease of."""

    id: uuid.UUID
    queue: str
    name: str
    attempt: int
    lease_owner: uuid.UUID
    lease_expires_at: datetime


def running_tasks(connection: Connection, workers: Sequence[uuid.UUID]) -> list[RunningTask]:
    """The running tasks leased by ``workers``, oldest lease first, at most 500.

    ``state = 'running'`` is a literal so the partial lease index (running rows only) can
    serve it; terminal history is never read.
    """
    if not workers:
        return []
    rows = connection.execute(
        select(
            Task.id, Task.queue, Task.name, Task.attempt, Task.lease_owner,
            Task.lease_expires_at,
        )
        .where(Task.state == literal_column(f"'{RUNNING}'"), Task.lease_owner.in_(workers))
        .order_by(Task.lease_expires_at, Task.id)
        .limit(_RUNNING_MAX)
    ).all()
    return [
        RunningTask(
            id=r.id, queue=r.queue, name=r.name, attempt=r.attempt, lease_owner=r.lease_owner,
            lease_expires_at=r.lease_expires_at,
        )
        for r in rows
    ]


def capabilities(
    connection: Connection, workers: Sequence[uuid.UUID]
) -> dict[uuid.UUID, list[tuple[str, str, int]]]:
    """Per worker, the ``(queue, name, version)`` identities it registered, sorted."""
    found: dict[uuid.UUID, list[tuple[str, str, int]]] = {}
    if not workers:
        return found
    for row in connection.execute(
        select(
            WorkerCapability.worker_id, WorkerCapability.queue, WorkerCapability.name,
            WorkerCapability.version,
        )
        .where(WorkerCapability.worker_id.in_(workers))
        .order_by(WorkerCapability.queue, WorkerCapability.name, WorkerCapability.version)
    ):
        found.setdefault(row.worker_id, []).append((row.queue, row.name, row.version))
    return found


#: How far the task page's tree reaches: ancestors up, descendants down and in all.
_TREE_DEPTH: Final = 20
_TREE_NODES: Final = 200


@dataclass(frozen=True)
class TaskTree:
    """A task's ancestors (the root first) and descendants (depth first, oldest first)."""

    ancestors: tuple[TaskRef, ...]
    #: ``(depth, task)``: depth 1 are the task's children.
    descendants: tuple[tuple[int, TaskRef], ...]
    #: Whether more descendants exist than the tree shows.
    truncated: bool


def _walk(connection: Connection, start: Any, link: Any, limit: int) -> list[Any]:
    """Rows of a recursive walk from ``start`` along ``link(node, walked)``, with depth."""
    node = aliased(Task)
    first = select(
        Task.id, Task.name, Task.version, Task.state, Task.parent_id, Task.created_at,
        literal(1).label("depth"),
    ).where(start).cte("walk", recursive=True)
    walk = first.union_all(
        select(
            node.id, node.name, node.version, node.state, node.parent_id, node.created_at,
            (first.c.depth + 1).label("depth"),
        ).where(link(node, first), first.c.depth < _TREE_DEPTH)
    )
    # PostgreSQL evaluates a recursive CTE lazily: the LIMIT stops the walk itself.
    return list(connection.execute(select(walk).limit(limit)).all())


def task_tree(connection: Connection, task: TaskDetail) -> TaskTree:
    """The family of ``task``: up through ``parent_id`` (at most 20 levels) and down (at most
    200 tasks, 20 levels), each step served by the primary key or the parent index."""
    ancestors: list[Any] = []
    if task.parent_id is not None:
        ancestors = _walk(
            connection, Task.id == task.parent_id,
            lambda node, walked: node.id == walked.c.parent_id, _TREE_DEPTH,
        )
    rows = _walk(
        connection, Task.parent_id == task.id,
        lambda node, walked: node.parent_id == walked.c.id, _TREE_NODES + 1,
    )
    children: dict[Any, list[Any]] = {}
    for row in sorted(rows[:_TREE_NODES], key=lambda r: (r.created_at, r.id)):
        children.setdefault(row.parent_id, []).append(row)
    ordered: list[tuple[int, TaskRef]] = []
    pending = [(1, row) for row in reversed(children.get(task.id, []))]
    while pending:
        depth, row = pending.pop()
        ordered.append((depth, _ref(row)))
        pending.extend((depth + 1, child) for child in reversed(children.get(row.id, [])))
    return TaskTree(
        ancestors=tuple(_ref(r) for r in sorted(ancestors, key=lambda r: -r.depth)),
        descendants=tuple(ordered),
        truncated=len(rows) > _TREE_NODES,
    )


def _ref(row: Any) -> TaskRef:
    return TaskRef(id=row.id, name=row.name, version=row.version, state=row.state)
