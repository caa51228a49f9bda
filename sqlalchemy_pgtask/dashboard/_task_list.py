"""dashboard._task_list: the dashboard's task list, newest first, a keyset page at a time;
never writes.

Its filters (a time range, a search by id or idempotency key), cursor and bounded reads go
beyond `sqlalchemy_pgtask.status.list_tasks`: a page reads one range of the index on
``(created_at, id)``, so its cost depends on neither the size of the history nor how rare
the filter's matches are.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Connection, select, tuple_

from sqlalchemy_pgtask.dashboard._payload import PayloadFilter, contains
from sqlalchemy_pgtask.dashboard._queries import PAGE_SIZE_MAX
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.models import IdempotencyKey, Task
from sqlalchemy_pgtask.states import TaskState
from sqlalchemy_pgtask.status import TaskSummary, check_list_filters
from sqlalchemy_pgtask.validation import check_free_text

__all__ = [
    "SCAN_LIMIT", "TaskFilters", "TaskPage", "parse_cursor", "search_match", "task_page",
]

#: The most tasks one page of a filtered task list reads before it answers with what it found
#: (`TaskPage.searched_to`): about 20 ms of PostgreSQL on a small host, so a filter that
#: matches nothing answers in bounded time, whatever the size of the history.
SCAN_LIMIT: Final = 25_000
#: The longest search text: an idempotency key's limit.
_SEARCH_MAX_BYTES: Final = 512

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
    #: Tasks whose payload contains this JSON object (`_payload`).
    payload: PayloadFilter | None = None

    def __post_init__(self) -> None:
        check_list_filters(state=self.state, queue=self.queue, name=self.name)
        for field in ("since", "until"):
            value = getattr(self, field)
            if value is not None and value.tzinfo is None:
                raise InvalidOptionError(field, "must be an aware datetime")
        if self.search is not None:
            check_free_text("search", self.search, _SEARCH_MAX_BYTES)
        if self.payload is not None and not isinstance(self.payload, PayloadFilter):
            raise InvalidOptionError("payload", "must be a PayloadFilter (parse_payload_filter)")


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


def search_match(text: str, queue: str | None) -> Any:
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
    sorting the matching rows, so the cost of a page does not grow with its depth. A page
    filtered by state, queue, name or payload reads one range of at most ``scan_limit`` tasks below
    the cursor: a filter that matches few or none of them answers with what it found,
    `TaskPage.searched_to` says how far back it looked, and ``next_cursor`` goes on from
    there. A search by task id or idempotency key reads just those tasks.

    ``after`` is the previous page's `TaskPage.next_cursor`: the next page starts below that
    position, so rows added meanwhile never shift it, and no row is read twice or skipped,
    in any isolation level.
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
    checks = [Task.__table__.c[column] == value for column, value in filtered]
    if filters.payload is not None:
        checks.append(contains(filters.payload))
    if filters.search is not None or not checks:
        # Every row the range yields is a match, or the search names the few rows to read.
        if filters.search is not None:
            checks.append(search_match(filters.search, filters.queue))
        rows = connection.execute(
            select(*_SUMMARY_COLUMNS).where(*bounds, *checks).order_by(*newest)
            .limit(limit + 1)
        ).all()
        return _page([_summary(row) for row in rows], limit)
    # A filtered page reads one range of keys: from the cursor (or the range's end) down to its
    # floor, the ``scan_limit``-th task below, found first by an index-only walk of
    # ``ix_tasks_created`` (a few milliseconds); the filters apply within that range, so no
    # plan reads more than it, however rare the match. A page whose matches run short ends at
    # the floor, and the next one starts below it. Pages are ranges of keys, not counts of rows
    # read, so tasks added or deleted between the two statements (under READ COMMITTED each
    # has its own snapshot) can never make a page skip or repeat one.
    below = connection.execute(
        select(Task.created_at, Task.id).where(*bounds).order_by(*newest)
        .offset(scan_limit - 1).limit(2)
    ).all()
    # One row: the range ends exactly at the floor, so the page reads it to the end.
    floor = below[0] if len(below) == 2 else None
    if floor is not None:
        bounds.append(tuple_(Task.created_at, Task.id) >= tuple_(floor.created_at, floor.id))
    rows = connection.execute(
        select(*_SUMMARY_COLUMNS).where(*bounds, *checks).order_by(*newest).limit(limit + 1)
    ).all()
    hits = [_summary(row) for row in rows]
    if len(hits) > limit or floor is None:
        return _page(hits, limit)
    return TaskPage(
        tasks=tuple(hits),
        next_cursor=_cursor(floor.created_at, floor.id),
        searched_to=floor.created_at,
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
