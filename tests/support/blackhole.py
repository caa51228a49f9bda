"""blackhole: a TCP proxy in front of PostgreSQL that can go silent and then come back.

It imitates an intermediary that keeps dead connections open (a pooler, a NAT or a firewall
that lost its state): while it black-holes, it accepts every connection and every byte, acks
them at the TCP level (the worker's keepalives are answered, its sends never fail), and
forwards nothing either way. `resume` restores the path for new connections; a connection
that lost bytes in the hole stays silent for ever, because its protocol stream is broken,
exactly as one behind a NAT that forgot it.

The proxy runs its own event loop in a daemon thread, so synchronous tests (which start
worker subprocesses) and asynchronous ones (with an in-process worker on the test's loop)
use it the same way, and a blocked test loop never holds the proxy up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from sqlalchemy import make_url

__all__ = ["BlackHoleProxy", "black_hole_proxy"]


class BlackHoleProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="black-hole-proxy")
        self._server: asyncio.Server | None = None
        self._silent = False
        #: Connections that lost bytes in the hole: they never forward again.
        self._broken: set[int] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        #: Connections accepted so far (a reconnecting worker opens new ones).
        self.accepted = 0
        #: Reads swallowed by the hole so far (something was sent into it).
        self.swallowed = 0

    # -- control (from any thread) ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        ready = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        ready.result(10)

    def black_hole(self) -> None:
        """From now on forward nothing, in either direction, on any connection."""
        self._silent = True

    def resume(self) -> None:
        """Forward again, for connections opened from now on (and ones that lost nothing)."""
        self._silent = False

    @property
    def silent(self) -> bool:
        return self._silent

    def url(self, database_url: str) -> str:
        """``database_url`` through this proxy (plain protocol, no TLS)."""
        url = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return url.update_query_dict({"sslmode": "disable"}).render_as_string(hide_password=False)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    # -- the proxy (on its own loop) -------------------------------------------------------

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        # Aborted, each connection's reads end: its task finishes on its own.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(client_w)
        key = id(client_w)
        try:
            # A connection opened in the hole never reaches the server: it waits, silently,
            # for a path that comes back only for new connections.
            if self._silent:
                self._broken.add(key)
                while await client_r.read(65536):
                    self.swallowed += 1
                return
            try:
                server_r, server_w = await asyncio.open_connection(*self._upstream)
            except OSError:
                return
            self._writers.add(server_w)

            async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                while data := await reader.read(65536):
                    if self._silent:
                        self._broken.add(key)
                    if key in self._broken:
                        self.swallowed += 1
                        continue  # swallowed: acked by TCP, never delivered
                    writer.write(data)
                    await writer.drain()

            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.gather(pump(client_r, server_w), pump(server_r, client_w))
            with contextlib.suppress(Exception):
                server_w.transport.abort()
            self._writers.discard(server_w)
        finally:
            with contextlib.suppress(Exception):
                client_w.transport.abort()
            self._writers.discard(client_w)
            self._broken.discard(key)


@contextlib.contextmanager
def black_hole_proxy(database_url: str) -> Iterator[BlackHoleProxy]:
    """A running `BlackHoleProxy` in front of ``database_url``'s server."""
    url = make_url(database_url)
    proxy = BlackHoleProxy(str(url.host or "127.0.0.1"), int(url.port or 5432))
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
