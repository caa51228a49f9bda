"""dashboard._charts: the overview's per-queue charts (tasks finished, failed, and the queue's
depth) over the last hour or day, read in one statement and drawn as inline SVG on the
server; never writes.

The statement reads the window's rows only, from three indexes, whatever the size of the
history:

* finished tasks per queue and bucket from ``ix_tasks_finished`` ``(queue, completed_at,
  state)``, index only: its leading column is the queue, so the queues are found first by a
  skip scan of the same index (one probe per queue) and each queue's window is one range;
* tasks created per queue and bucket from ``ix_tasks_created`` (the window's range, and the
  rows for their queue).

The outstanding tasks per queue now are the overview's own counts, in the same snapshot.

With the dashboard's `ChartCache`, both ranges start at the first bucket the cache does not
hold (the open one, once the closed ones are cached): the statement reads the last bucket's
rows, not the window's, and the closed buckets come from the process's memory. What that can
leave stale is in docs/dashboard.md (Charts).

Depth is not stored over time: a bucket's is the depth now, less the tasks created after
the bucket, plus those finished after it. A finished task deleted within the window (a
retention shorter than the window) makes the older buckets read low.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Final, cast

from markupsafe import Markup, escape
from sqlalchemy import Connection, text

from sqlalchemy_pgtask.dashboard._chart_cache import CLOSED_GRACE_SECONDS, ChartCache, Counts
from sqlalchemy_pgtask.states import TERMINAL_STATES
from sqlalchemy_pgtask.status._overview import queue_skip_scan

__all__ = ["WINDOWS", "ChartWindow", "QueueCharts", "bars_svg", "depth_svg", "queue_charts"]


@dataclass(frozen=True)
class ChartWindow:
    """A chart's time span: ``buckets`` buckets of ``bucket_seconds``, the last one now."""

    name: str
    label: str
    bucket_seconds: int
    buckets: int


#: The windows the overview offers (``?chart=hour|day``); the first is the default.
WINDOWS: Final = {
    "hour": ChartWindow("hour", "last hour", 60, 60),
    "day": ChartWindow("day", "last day", 900, 96),
}
#: The most queues charted; more are counted in `QueueCharts.more`, busiest first.
CHARTED_QUEUES_MAX: Final = 20


def _literals(states: tuple[str, ...]) -> str:
    # Literals, not parameters: the partial indexes' predicates must be provably implied.
    return ", ".join(f"'{state}'" for state in states)


_TERMINAL: Final = _literals(TERMINAL_STATES)
# The window's start, written out wherever it is used rather than read from a CTE: the
# planner then estimates each range from its value (stable functions are evaluated for
# the estimate), where a CTE's column would make it guess a third of the table, plan for a
# million rows and spend more time compiling the statement (JIT) than running it.
# Seconds as double precision (date_part), not numeric (extract): the buckets are computed
# for every row of the window, and numeric arithmetic made them most of the statement's time.
# (date_bin would do it, but PostgreSQL 13 has none.)
_START_EPOCH: Final = "((floor(date_part('epoch', pgtask.now()) / :secs) - :n + 1) * :secs)"
_START: Final = f"to_timestamp({_START_EPOCH})"


# The buckets already cached (`ChartCache`) are not read: the ranges start at the first
# bucket not cached, provided the cache starts at or before the window's start and ends in it,
# after it and no later than the open bucket (else a clock stepped back: read the window).
_OPEN_EPOCH: Final = "(floor(date_part('epoch', pgtask.now()) / :secs) * :secs)"
_FROM_EPOCH: Final = (
    f"(CASE WHEN CAST(:cached_from AS float8) <= {_START_EPOCH}"
    f" AND CAST(:cached_to AS float8) > {_START_EPOCH}"
    f" AND CAST(:cached_to AS float8) <= {_OPEN_EPOCH}"
    f" THEN CAST(:cached_to AS float8) ELSE {_START_EPOCH} END)"
)
_FROM: Final = f"to_timestamp({_FROM_EPOCH})"


def _bucket(column: str) -> str:
    # Absolute bucket numbers, so that a cached bucket keeps its number as the window moves.
    return f"floor(date_part('epoch', {column}) / :secs)::bigint"


# Every interpolated piece is a constant of this module (states, limits, expressions of
# parameters): no input reaches the text.
_STATEMENT: Final = text(f"""
WITH RECURSIVE queues AS ({queue_skip_scan(TERMINAL_STATES)})
SELECT 'window' AS kind, NULL AS queue, NULL::bigint AS bucket, 0::bigint AS succeeded,
       0::bigint AS failed, 0::bigint AS cancelled, {_START} AS start,
       {_FROM_EPOCH} AS read_from, date_part('epoch', pgtask.now()) AS now
UNION ALL
SELECT 'finished', q.queue, f.bucket, f.succeeded, f.failed, f.cancelled, NULL, NULL, NULL
FROM queues AS q CROSS JOIN LATERAL (
    SELECT {_bucket('t.completed_at')} AS bucket,
           count(*) FILTER (WHERE t.state = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE t.state = 'failed') AS failed,
           count(*) FILTER (WHERE t.state = 'cancelled') AS cancelled
    FROM pgtask.tasks AS t
    WHERE t.queue = q.queue AND t.state IN ({_TERMINAL}) AND t.completed_at >= {_FROM}
    GROUP BY 1
) AS f
WHERE q.queue IS NOT NULL
UNION ALL
SELECT 'created', t.queue, {_bucket('t.created_at')}, count(*), 0, 0, NULL, NULL, NULL
FROM pgtask.tasks AS t
WHERE t.created_at >= {_FROM}
GROUP BY 2, 3
""")  # noqa: S608 (constants only)


@dataclass(frozen=True)
class QueueCharts:
    """One queue's series over a window, a value per bucket, oldest first."""

    queue: str
    succeeded: tuple[int, ...]
    failed: tuple[int, ...]
    cancelled: tuple[int, ...]
    #: Outstanding tasks (pending, running, waiting) at each bucket's end (the last: now).
    depth: tuple[int, ...]

    @property
    def finished(self) -> tuple[int, ...]:
        return tuple(map(sum, zip(self.succeeded, self.failed, self.cancelled, strict=True)))


@dataclass(frozen=True)
class Charts:
    """Every charted queue over ``window``, from ``start`` (database time; None when no
    queue has a task)."""

    window: ChartWindow
    start: datetime | None
    queues: tuple[QueueCharts, ...]
    #: Queues with activity in the window left out (`CHARTED_QUEUES_MAX`).
    more: int


def queue_charts(
    connection: Connection, window: ChartWindow, outstanding: Mapping[str, int],
    cache: ChartCache | None = None,
) -> Charts:
    """Per queue, finished, failed and depth over ``window``: one statement (see above).

    ``outstanding`` is each queue's pending, running and waiting tasks now, read in the same
    snapshot (the overview has counted them already): the depth's last value. With a
    ``cache``, the closed buckets it holds are not read again, and those read are kept.
    """
    secs = window.bucket_seconds
    cached = None if cache is None else cache.view(window.name)
    used = None if cached is None else cached[:2]
    params = {
        "secs": secs, "n": window.buckets,
        "cached_from": None if used is None else used[0] * secs,
        "cached_to": None if used is None else used[1] * secs,
    }
    read: dict[int, dict[str, list[int]]] = {}
    head = None
    for row in connection.execute(_STATEMENT, params):
        if row.kind == "window":
            head = row
            continue
        found = read.setdefault(row.bucket, {}).setdefault(row.queue, [0, 0, 0, 0])
        if row.kind == "created":
            found[3] += row.succeeded
        else:
            for at, key in enumerate(("succeeded", "failed", "cancelled")):
                found[at] += getattr(row, key)
    assert head is not None  # the statement's first row, always there
    first = round(head.start.timestamp()) // secs
    read_from = round(head.read_from) // secs
    frozen = {b: {q: cast(Counts, tuple(c)) for q, c in queues.items()}
              for b, queues in read.items()}
    known = {} if cached is None else {
        b: q for b, q in cached[2].items() if first <= b < read_from
    }
    if cache is not None:
        # Buckets that ended a grace ago: their rows are all committed (see _chart_cache).
        closed_end = int((head.now - CLOSED_GRACE_SECONDS) // secs)
        cache.store(window.name, used=used, first=first, read_from=read_from,
                    closed_end=max(read_from, min(closed_end, first + window.buckets)),
                    read=frozen)
    return _charts(window, head.start, outstanding, first, {**known, **frozen})


def _charts(
    window: ChartWindow, start: datetime, outstanding: Mapping[str, int], first: int,
    buckets: Mapping[int, Mapping[str, Counts]],
) -> Charts:
    size = window.buckets
    zeros = (0,) * size
    counts: dict[str, dict[str, list[int]]] = {}

    def series(queue: str) -> dict[str, list[int]]:
        return counts.setdefault(queue, {key: list(zeros) for key in (
            "succeeded", "failed", "cancelled", "created", "outstanding"
        )})

    for queue, now in outstanding.items():
        if now:
            series(queue)["outstanding"][0] = now
    for bucket, queues in buckets.items():
        at = bucket - first
        if not 0 <= at < size:  # a clock step back could put a row past the window
            continue
        for queue, values in queues.items():
            found = series(queue)
            for key, value in zip(("succeeded", "failed", "cancelled", "created"), values,
                                  strict=True):
                found[key][at] += value
    charted = []
    for queue, found in counts.items():
        depth = [0] * size
        level = found["outstanding"][0]
        for bucket in range(size - 1, -1, -1):
            depth[bucket] = max(level, 0)
            finished = sum(found[key][bucket] for key in ("succeeded", "failed", "cancelled"))
            # The bucket before this one ended before these were created and finished.
            level += finished - found["created"][bucket]
        charted.append(QueueCharts(
            queue=queue, succeeded=tuple(found["succeeded"]), failed=tuple(found["failed"]),
            cancelled=tuple(found["cancelled"]), depth=tuple(depth),
        ))
    charted.sort(key=lambda q: (-(sum(q.finished) + max(q.depth)), q.queue))
    return Charts(
        window=window, start=start if charted else None,
        queues=tuple(charted[:CHARTED_QUEUES_MAX]),
        more=max(0, len(charted) - CHARTED_QUEUES_MAX),
    )


# -- drawing ------------------------------------------------------------------------------

_WIDTH: Final = 240
_HEIGHT: Final = 56


@functools.lru_cache(maxsize=8)
def _labels(start: datetime | None, window: ChartWindow) -> tuple[str, ...]:
    # Every chart of a page shares the window's labels: formatted once, not once per bar.
    if start is None:
        return tuple(f"bucket {bucket + 1}" for bucket in range(window.buckets))
    return tuple(
        (start + timedelta(seconds=bucket * window.bucket_seconds))
        .astimezone(timezone.utc).strftime("%H:%M UTC")
        for bucket in range(window.buckets)
    )


def bars_svg(
    values: tuple[int, ...], *, start: datetime | None, window: ChartWindow, what: str,
    kind: str,
) -> Markup:
    """Bars of ``values`` (one per bucket) as an ``<svg>``: each bar's ``<title>`` says its
    time and count, the chart's ``data-total`` the sum; a scale of the largest bar."""
    top = max(values, default=0)
    step = _WIDTH / max(len(values), 1)
    labels = _labels(start, window)
    parts = []
    for bucket, value in enumerate(values):
        if value == 0:
            continue
        height = max(1.0, value / top * (_HEIGHT - 2))
        parts.append(
            f'<rect x="{bucket * step:.2f}" y="{_HEIGHT - height:.2f}" '
            f'width="{max(step - 0.5, 0.5):.2f}" height="{height:.2f}">'
            f"<title>{labels[bucket]}: {value} {escape(what)}</title></rect>"
        )
    total = sum(values)
    return _svg(kind, f"{total} {what} in the {window.label}, at most {top} a bucket",
                "".join(parts), total=total, peak=top)


def depth_svg(values: tuple[int, ...], *, window: ChartWindow) -> Markup:
    """Depth over the window as a line over an area, as an ``<svg>`` (``data-now``: the
    depth now)."""
    top = max(max(values, default=0), 1)
    step = _WIDTH / max(len(values) - 1, 1)
    points = " ".join(
        f"{i * step:.2f},{_HEIGHT - 1 - value / top * (_HEIGHT - 2):.2f}"
        for i, value in enumerate(values)
    )
    now = values[-1] if values else 0
    body = (
        f'<polygon class="area" points="0,{_HEIGHT} {points} {_WIDTH},{_HEIGHT}"></polygon>'
        f'<polyline class="line" points="{points}"><title>{now} outstanding now, at most '
        f"{max(values, default=0)} in the {window.label}</title></polyline>"
    )
    return _svg("depth", f"depth now {now}, at most {max(values, default=0)}", body,
                total=now, peak=max(values, default=0))


def _svg(kind: str, label: str, body: str, *, total: int, peak: int) -> Markup:
    # Every value here is a number or a fixed word, and the labels are escaped: no user data
    # reaches the markup unescaped (queue names are the template's, escaped there).
    return Markup(  # noqa: S704
        f'<svg class="chart chart-{kind}" viewBox="0 0 {_WIDTH} {_HEIGHT}" width="{_WIDTH}" '
        f'height="{_HEIGHT}" role="img" aria-label="{escape(label)}" data-chart="{kind}" '
        f'data-total="{total}" data-peak="{peak}" preserveAspectRatio="none">'
        f'<line class="axis" x1="0" y1="{_HEIGHT - 0.5}" x2="{_WIDTH}" y2="{_HEIGHT - 0.5}">'
        f"</line>{body}</svg>"
    )
