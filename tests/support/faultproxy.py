"""faultproxy: a TCP proxy in front of PostgreSQL that breaks a connection at a chosen moment.

Real faults, not mocks: the worker talks to the real server through this proxy, and the proxy
can drop a connection

* **before** a statement reaches the server (`drop_before`): the server never runs it; or
* **after** the server committed it (`drop_after_commit`): the server runs and commits the
  statement (autocommit), and the connection breaks before the client reads the answer, so
  the client cannot know whether it committed.

A statement is recognised by bytes of its SQL text, which psycopg sends on the first
executions on a connection (before it prepares the statement). Connect with
``sslmode=disable`` so the stream is plain protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

__all__ = ["FaultProxy", "fault_proxy"]

#: A ReadyForQuery message: the server finished the statement (and its implicit commit).
_READY = b"Z\x00\x00\x00\x05"


@dataclass
class _Rule:
    marker: bytes
    after_commit: bool
    times: int


@dataclass
class FaultProxy:
    upstream_host: str
    upstream_port: int
    port: int = 0
    dropped: int = 0
    _rules: list[_Rule] = field(default_factory=list)
    _dropped_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Every proxied connection's ``close_all``: the proxy's end breaks them all, since
    #: ``Server.close`` leaves open connections (a worker may leave one behind on a dead
    #: path), whose sockets would otherwise outlive the test's event loop.
    _open: set[Callable[[], None]] = field(default_factory=set)

    def drop_before(self, marker: bytes, *, times: int = 1) -> None:
        """Break the next ``times`` connections that send ``marker``, before the server sees it."""
        self._rules.append(_Rule(marker, False, times))

    def drop_after_commit(self, marker: bytes, *, times: int = 1) -> None:
        """Let the statement holding ``marker`` run and commit, then break the connection."""
        self._rules.append(_Rule(marker, True, times))

    async def wait_dropped(self, count: int = 1, timeout: float = 30.0) -> None:
        async def reached() -> None:
            while self.dropped < count:
                self._dropped_event.clear()
                await self._dropped_event.wait()

        await asyncio.wait_for(reached(), timeout)

    def _match(self, data: bytes) -> _Rule | None:
        for rule in self._rules:
            if rule.times > 0 and rule.marker in data:
                rule.times -= 1
                return rule
        return None

    def _note_drop(self) -> None:
        self.dropped += 1
        self._dropped_event.set()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:
            client_w.close()
            return
        kill_at_ready = asyncio.Event()
        done = asyncio.Event()

        def close_all() -> None:
            done.set()
            self._open.discard(close_all)
            for writer in (client_w, server_w):
                with contextlib.suppress(Exception):
                    writer.transport.abort()

        self._open.add(close_all)

        async def client_to_server() -> None:
            while not done.is_set():
                data = await client_r.read(65536)
                if not data:
                    break
                rule = self._match(data)
                if rule is not None and not rule.after_commit:
                    self._note_drop()
                    close_all()
                    return
                if rule is not None:
                    kill_at_ready.set()
                server_w.write(data)
                await server_w.drain()
            close_all()

        async def server_to_client() -> None:
            held = b""
            while not done.is_set():
                data = await server_r.read(65536)
                if not data:
                    break
                if kill_at_ready.is_set():
                    held += data
                    if _READY in held:  # committed: break before the client learns of it
                        self._note_drop()
                        close_all()
                        return
                    continue
                client_w.write(data)
                await client_w.drain()
            close_all()

        with contextlib.suppress(Exception):
            await asyncio.gather(client_to_server(), server_to_client())
        close_all()


@contextlib.asynccontextmanager
async def fault_proxy(host: str, port: int) -> AsyncIterator[FaultProxy]:
    """A running proxy to ``host:port`` on a free local port."""
    proxy = FaultProxy(host, port)
    server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        for close_all in list(proxy._open):
            close_all()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
