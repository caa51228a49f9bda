"""worker._http: the tiny HTTP server for ``/metrics``, ``/healthz`` and ``/readyz``; GET only.

It runs on the worker's own event loop, on purpose: a loop that is blocked (a handler that
never yields) cannot answer, so the liveness probe fails exactly when the worker cannot work.
Each request is read with a deadline and a size limit and answered once (``Connection:
close``); nothing a client sends can make it wait for long or hold much memory. At most
`_MAX_CLIENTS` connections are held at a time: a new one closes the oldest, so clients that
connect and send nothing can never use up the process's file descriptors (which the worker
needs for its database connections), and a probe that sends its request at once is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Final

from sqlalchemy_pgtask._asyncio import bounded

__all__ = ["PLAIN_TEXT", "ProbeServer", "Response", "text"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: A status code, a content type and a body.
Response = tuple[int, str, bytes]

PLAIN_TEXT: Final = "text/plain; charset=utf-8"

_REASONS: Final = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    500: "Internal Server Error", 503: "Service Unavailable",
}
#: The longest a client may take to send its request, and the most it may send.
_READ_TIMEOUT: Final = 5.0
_HEAD_LIMIT: Final = 16 * 1024
#: Connections held at once; probes and scrapes need a few.
_MAX_CLIENTS: Final = 32


class ProbeServer:
    """Serves ``routes`` (path to a function that makes the response) on ``host:port``."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Callable[[], Response]]) -> None:
        self.host = host
        self.port = port
        self._routes = dict(routes)
        self._server: asyncio.Server | None = None
        #: The connections being served and their writers, oldest first (a dict keeps
        #: insertion order).
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        #: Connections closed to make room, until their task has ended.
        self._evicted: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen; ``port`` 0 takes a free port, and `port` then tells which.

        :raises OSError: the address cannot be listened on (in use, not local, no permission).
        """
        try:
            self._server = await asyncio.start_server(
                self._accept, self.host, self.port, limit=_HEAD_LIMIT
            )
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror}"
            ) from exc
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in self._clients.values():
            writer.close()  # a task cancelled before it started never reaches its own close
        clients = [*self._clients, *self._evicted]
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        with contextlib.suppress(Exception):
            await bounded(server.wait_closed(), _READ_TIMEOUT)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._clients) >= _MAX_CLIENTS:
            oldest = next(iter(self._clients))
            self._clients.pop(oldest).close()  # here: a task not started yet never would
            self._evicted.add(oldest)
            oldest.add_done_callback(self._evicted.discard)
            oldest.cancel()
        client = asyncio.ensure_future(self._serve(reader, writer))
        self._clients[client] = writer
        client.add_done_callback(self._ended)

    def _ended(self, client: asyncio.Task[None]) -> None:
        self._clients.pop(client, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await bounded(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return  # gone, too long or too slow: nothing worth an answer
            method, path = _request_line(head)
            status, content_type, body = self._respond(method, path)
            head_out = (
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode("ascii")
            writer.write(head_out if method == "HEAD" else head_out + body)
            await bounded(writer.drain(), _READ_TIMEOUT)
        except (OSError, TimeoutError):
            pass  # the client went away
        finally:
            writer.close()

    def _respond(self, method: str, path: str) -> Response:
        if not method:
            return 400, PLAIN_TEXT, b"bad request\n"
        route = self._routes.get(path)
        if route is None:
            return 404, PLAIN_TEXT, b"not found: try /metrics, /healthz or /readyz\n"
        if method not in ("GET", "HEAD"):
            return 405, PLAIN_TEXT, b"only GET and HEAD\n"
        try:
            return route()
        except Exception:
            logger.exception("metrics endpoint %s failed", path)
            return 500, PLAIN_TEXT, b"internal error\n"


def _request_line(head: bytes) -> tuple[str, str]:
    """The method and the path (without its query) of a request; empty if malformed."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1].split("?", 1)[0]


def text(status: int, message: str) -> Response:
    """A plain-text response of one line."""
    return status, PLAIN_TEXT, f"{message}\n".encode()
