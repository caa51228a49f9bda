"""dashboard._throttle: failed guesses of the admin token, counted per client address.

A token is checked wherever a request offers one (the login form, a ``Bearer`` header), and
an online guesser would otherwise get as many tries as the server answers requests. After
`LIMIT` failures from one address within `WINDOW` seconds, that address's next guesses are
not checked at all until the oldest failure is `WINDOW` old: ten guesses per five minutes,
however fast it asks. A right token clears the address's count. Addresses are the ones the
ASGI server reports: behind a proxy that is the proxy, unless the server is told to trust
its forwarded headers (uvicorn's ``--proxy-headers``), and then every client behind it
shares one count.

In memory, per dashboard application (a process serving several shares nothing), bounded
to `ADDRESSES` addresses: beyond that the least recently failed are forgotten.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Final

__all__ = ["ADDRESSES", "LIMIT", "WINDOW", "Throttle", "Throttled"]

LIMIT: Final = 10
WINDOW: Final = 300.0
ADDRESSES: Final = 10_000


class Throttled(Exception):
    """This address failed too often: it may guess again in `retry_after` seconds."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = max(1, int(retry_after + 0.999))
        super().__init__(f"too many wrong tokens from this address; retry in {self.retry_after} s")


class Throttle:
    """Failures per address within the last `WINDOW` seconds (`clock`'s)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, address: str) -> None:
        """Raise `Throttled` if ``address`` may not guess now."""
        with self._lock:
            failures = self._recent(address)
            if failures is not None and len(failures) >= LIMIT:
                raise Throttled(failures[0] + WINDOW - self.clock())

    def failed(self, address: str) -> None:
        with self._lock:
            failures = self._recent(address)
            if failures is None:
                failures = self._failures[address] = deque(maxlen=LIMIT)
                while len(self._failures) > ADDRESSES:
                    self._failures.popitem(last=False)
            else:
                self._failures.move_to_end(address)
            failures.append(self.clock())

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)

    def _recent(self, address: str) -> deque[float] | None:
        failures = self._failures.get(address)
        if failures is None:
            return None
        oldest = self.clock() - WINDOW
        while failures and failures[0] <= oldest:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        return failures
