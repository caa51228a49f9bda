"""dashboard._chart_cache: the counts of the charts' closed buckets, kept in the dashboard
process so that a request reads only the buckets still open from the database.

A task's ``created_at`` and ``completed_at`` are written as database time when its row is
written, so once a bucket has ended (and a grace for the transactions that wrote them to
commit has passed) no new row lands in it: its counts can only fall, when a row leaves it
(retention deleting a finished task, a finished task retried). The cache keeps, per window, one
contiguous span of closed buckets from the window's start, as ``{bucket: {queue: counts}}``
with only non-zero counts stored, and at most `CACHE_ENTRIES_MAX` (queue, bucket) entries
over all windows: a span that would grow past it stops growing, and the buckets it leaves
out are read from the database on every request, as without a cache.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Final

__all__ = ["CACHE_ENTRIES_MAX", "CLOSED_GRACE_SECONDS", "ChartCache", "Counts"]

#: The most (queue, bucket) entries kept over every window: about 200 bytes each, so a few MB.
CACHE_ENTRIES_MAX: Final = 20_000
#: A bucket is cached once it ended this long ago: a row written by a statement that began
#: before the bucket's end and committed within this grace is still counted.
CLOSED_GRACE_SECONDS: Final = 60

#: (succeeded, failed, cancelled, created) in one bucket of one queue.
Counts = tuple[int, int, int, int]


@dataclass
class _Span:
    #: Absolute bucket numbers (epoch seconds // the window's bucket) ``[first, end)``.
    first: int
    end: int
    buckets: dict[int, dict[str, Counts]] = field(default_factory=dict)

    def entries(self) -> int:
        return sum(map(len, self.buckets.values()))


class ChartCache:
    """Closed buckets' counts per window (thread-safe: the dashboard's reads run in a pool)."""

    def __init__(self, max_entries: int = CACHE_ENTRIES_MAX) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._spans: dict[str, _Span] = {}

    def span(self, window: str) -> tuple[int, int] | None:
        """The cached buckets ``[first, end)`` of ``window``, or None."""
        with self._lock:
            found = self._spans.get(window)
            return None if found is None else (found.first, found.end)

    def entries(self) -> int:
        """(queue, bucket) entries held over every window."""
        with self._lock:
            return sum(span.entries() for span in self._spans.values())

    def view(self, window: str) -> tuple[int, int, dict[int, dict[str, Counts]]] | None:
        """The cached span of ``window``, ``(first, end, buckets)``, copied in one step (a
        request merges what it saw, whatever other requests store meanwhile), or None."""
        with self._lock:
            found = self._spans.get(window)
            if found is None:
                return None
            return found.first, found.end, {b: dict(q) for b, q in found.buckets.items()}

    def store(
        self, window: str, *, used: tuple[int, int] | None, first: int, read_from: int,
        closed_end: int, read: dict[int, dict[str, Counts]],
    ) -> None:
        """Keep the buckets ``[read_from, closed_end)`` just ``read`` after the span ``used``
        (None: the window read whole from ``first``), and drop the buckets before ``first``
        (the window's start now). Skipped if another request changed the span meanwhile."""
        with self._lock:
            current = self._spans.get(window)
            if (None if current is None else (current.first, current.end)) != used:
                return
            if current is None or read_from != current.end:
                current = _Span(first, read_from)
            current.buckets = {b: q for b, q in current.buckets.items() if b >= first}
            current.first = max(current.first, first)
            room = self.max_entries - sum(
                span.entries() for name, span in self._spans.items() if name != window
            ) - current.entries()
            for bucket in range(read_from, closed_end):
                queues = read.get(bucket, {})
                if len(queues) > room:
                    break
                if queues:
                    current.buckets[bucket] = dict(queues)
                room -= len(queues)
                current.end = bucket + 1
            self._spans[window] = current
