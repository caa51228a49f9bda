"""A monotonic clock that moves only when a test moves it, for the worker's set-aside rests."""

from __future__ import annotations


class StoppedClock:
    """Call it for the time; add to ``now`` to move it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
