"""worker._reconnect: which failures are worth retrying, how long to wait (both from
`sqlalchemy_pgtask._failures`, which the scheduler and the result waiters share), held
connections, and the engine a worker makes for itself from a URL (`owned_engine`, with
`load_json`).

Every loop of the worker retries transient failures (a lost or refused connection, a lock or
statement timeout, a serialisation failure) after a backoff with full jitter, so reconnecting
workers spread out. Anything else is a bug or a broken installation: the loop lets it
propagate and the worker stops (see the supervisor in ``_runtime``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from sqlalchemy import URL, Engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

# Re-exported: the worker's loops import them from here.
from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask._failures import Backoff, brief, is_transient
from sqlalchemy_pgtask._url import database_url
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.worker._attempts import NO_OBSERVER, Observer
from sqlalchemy_pgtask.worker._deadlines import (
    Liveness,
    long_deadline,
    sever,
    severing,
    severing_each,
)

__all__ = [
    "NETWORK_DEFAULTS", "PLANNER_SETTINGS", "Backoff", "HeldConnection", "brief",
    "is_transient", "load_json", "network_settings", "owned_engine",
]


#: Planner settings for the worker's connections. Every statement they run is meant to probe an
#: index; a plan cached while a table was nearly empty (a new install, or right after a big
#: cleanup) would otherwise keep scanning it sequentially as it grows. The penalty that makes
#: a sequential scan unattractive also lifts a plan that needs one (a small table such as
#: ``workers``) above ``jit_above_cost``: JIT would compile it on every execution (~0.7 s of
#: CPU), and never pays off for these short statements.
PLANNER_SETTINGS: Final = (
    ("enable_seqscan", "off"), ("plan_cache_mode", "force_generic_plan"), ("jit", "off"),
)


_DECODER: Final = json.JSONDecoder()


def load_json(data: bytes) -> object:
    """``json.loads`` for the UTF-8 text psycopg hands over, at a third of the cost.

    ``json.loads`` of bytes first sniffs their encoding (UTF-16 and UTF-32 included), and then
    looks for whitespace around the value with two regular-expression matches. What PostgreSQL
    sends a UTF-8 client is UTF-8, and ``jsonb`` text has no such whitespace (``json`` text,
    which keeps it, takes the full decode). ~2 us saved per value: one payload per task.
    """
    text = data.decode()
    try:
        value, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return _DECODER.decode(text)  # leading whitespace, or not JSON: decode tells which
    return value if end == len(text) else _DECODER.decode(text)


#: libpq settings of the connections a worker opens from a URL, unless the URL sets them. A
#: server that stops answering (a network partition, a host that froze) would otherwise hold
#: a connect or a statement until the kernel gives up on the socket, about 15 minutes: the
#: connect fails after 10 s, and an established connection whose sent data goes unacknowledged
#: for 15 s, or that answers no keepalive probe for about 20 s while waiting, fails too; the
#: worker's loops then reconnect as after any lost connection.
NETWORK_DEFAULTS: Final[Mapping[str, str]] = MappingProxyType({
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "3",
    "keepalives_count": "3",
    "tcp_user_timeout": "15000",
})


def _postgresql_url(database: object) -> URL:
    """A worker's database URL: a PostgreSQL one (any driver named: the worker uses psycopg),
    libpq's multi-host failover form included (`sqlalchemy_pgtask._url`)."""
    if not isinstance(database, (str, URL)):
        raise InvalidOptionError(
            "database",
            f"must be a URL or an AsyncEngine, got {type(database).__name__}"
            + (" (a worker needs an AsyncEngine)" if isinstance(database, Engine) else ""),
        )
    return database_url(database)


def network_settings(url: URL) -> dict[str, str]:
    """`NETWORK_DEFAULTS` but those the URL, a service file or libpq's environment sets."""
    if "service" in url.query or os.environ.get("PGSERVICE"):
        return {}  # a service file may set any of them: leave them all to it
    chosen = {k: v for k, v in NETWORK_DEFAULTS.items() if k not in url.query}
    if os.environ.get("PGCONNECT_TIMEOUT"):
        chosen.pop("connect_timeout", None)
    return chosen


def owned_engine(url: object) -> AsyncEngine:
    """The engine a worker given a URL creates (and disposes of) for itself.

    An engine the application passes in keeps its own JSON deserializer: its handlers may
    rely on it (decimals, say), and its own connection settings (`NETWORK_DEFAULTS` are a
    good start for them).

    :raises InvalidOptionError: ``url`` is not a PostgreSQL URL.
    """
    parsed = _postgresql_url(url)
    return create_async_engine(
        parsed,
        connect_args=network_settings(parsed),
        pool_size=10,
        max_overflow=10,
        # Errors are logged; statement parameters carry task payloads and results.
        hide_parameters=True,
        json_deserializer=load_json,
    )


async def _discard(connection: AsyncConnection) -> None:
    await connection.close()


def _milliseconds(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class HeldConnection:
    """One autocommit connection kept across statements, replaced after any error.

    A pool checkout per statement would cost more than the hot statements' own round trips.
    Loops that share one take turns (`use` holds a lock).
    The session settings (timeouts, planner) are applied once per physical connection and
    reset before it goes back to a pool the application may share.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lock_timeout: float,
        statement_timeout: float,
        planner: Sequence[tuple[str, str]] = PLANNER_SETTINGS,
        lock: tuple[int, int] | None = None,
        deadline: float | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self._engine = engine
        #: The longest one `use` may take, connecting included (`worker._deadlines`).
        self.deadline = long_deadline(statement_timeout) if deadline is None else deadline
        self._liveness = liveness
        #: Set while no `use` is in progress.
        self._idle = asyncio.Event()
        self._idle.set()
        #: An advisory lock every physical connection holds (shared) while it is open: the
        #: worker's sign of life (`statements.rescue`).
        self._lock = lock
        self._settings = (
            ("lock_timeout", _milliseconds(lock_timeout)),
            ("statement_timeout", _milliseconds(statement_timeout)),
            # Every statement (and the short transactions of durable waits) relies on READ
            # COMMITTED: a fresh snapshot per statement, and rechecks of rows it had to wait
            # for. A database whose default is REPEATABLE READ must not change that.
            ("default_transaction_isolation", "read committed"),
            *planner,
        )
        self._connection: AsyncConnection | None = None
        self._turn = asyncio.Lock()
        self.observer: Observer = NO_OBSERVER

    @contextlib.asynccontextmanager
    async def use(
        self, deadline: float | None = None, *, each_statement: bool = False
    ) -> AsyncIterator[AsyncConnection]:
        """The connection, for statements that must be over within ``deadline`` seconds
        (default: `deadline`), or each within it if ``each_statement``; past it, the
        connection is severed and the body fails with `TimeoutError` (transient)."""
        seconds = self.deadline if deadline is None else deadline
        async with self._turn, self._use(seconds, each_statement) as c:
            yield c

    @contextlib.asynccontextmanager
    async def _use(self, seconds: float, each: bool = False) -> AsyncIterator[AsyncConnection]:
        self._idle.clear()
        try:
            until = time.monotonic() + seconds
            if self._connection is None:
                await self._open(seconds)
            assert self._connection is not None
            connection = self._connection
            sever_late = (
                severing_each(connection, seconds) if each
                else severing(connection, until - time.monotonic())
            )
            with sever_late as fired:
                try:
                    yield connection
                except BaseException as exc:
                    # Its state is unknown (broken, or mid-statement when cancelled): start
                    # afresh.
                    await self.close(reset=False)
                    if fired[0] and isinstance(exc, Exception):
                        raise TimeoutError(
                            f"no answer from PostgreSQL within {seconds:g} s; connection severed"
                        ) from exc
                    answered = getattr(getattr(exc, "orig", None), "sqlstate", None)
                    if self._liveness is not None and answered:  # the server answered
                        self._liveness.touch()
                    raise
            if fired[0]:  # finished as the deadline fired: the connection is gone
                await self.close(reset=False)
            elif self._liveness is not None:
                self._liveness.touch()
        finally:
            self._idle.set()

    async def _open(self, seconds: float) -> None:
        connection = await bounded(self._engine.connect(), seconds, discard=_discard)
        self._connection = connection  # so that `sever` finds it during the setup too
        try:
            with severing(connection, seconds):
                await connection.execute(
                    select(*(func.set_config(name, value, False) for name, value in self._settings))
                )
                if self._lock is not None:
                    await connection.execute(select(func.pg_advisory_lock_shared(*self._lock)))
        except BaseException:
            self._connection = None
            with contextlib.suppress(Exception):
                await connection.invalidate()
            with contextlib.suppress(Exception):
                await connection.close()
            raise
        self.observer.connected(self)

    @property
    def busy(self) -> bool:
        """Whether a `use` is in progress."""
        return not self._idle.is_set()

    def sever(self) -> bool:
        """Sever the connection if a statement may be in flight on it (see
        `worker._deadlines`): whatever waits on it fails at once, without the driver's
        cancel request over a network that may be dead. Whether there was one to sever."""
        return self.busy and self._connection is not None and sever(self._connection)

    async def settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no `use` is in progress; whether none is."""
        with contextlib.suppress(TimeoutError):
            await bounded(self._idle.wait(), timeout)
        return not self.busy

    async def close(self, *, reset: bool = True) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        with contextlib.suppress(Exception), severing(connection, self.deadline):
            if reset:
                if self._lock is not None:
                    await connection.execute(select(func.pg_advisory_unlock_shared(*self._lock)))
                for name, _ in self._settings:
                    await connection.execute(text(f"RESET {name}"))
            else:
                await connection.invalidate()
        with contextlib.suppress(Exception):
            await connection.close()
