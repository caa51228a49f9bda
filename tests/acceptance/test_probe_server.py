"""The metrics and probe server under clients that misbehave, over real sockets.

Its read deadline is made far longer than `PATIENCE` here, so a connection the server closes
within `PATIENCE` was closed for the reason under test, never by that deadline.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from sqlalchemy_pgtask.worker import _http
from sqlalchemy_pgtask.worker._http import ProbeServer, text
from tests.acceptance.test_metrics import get
from tests.support.waiting import PATIENCE, SLOW_POLL


@pytest.fixture
def slow_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_http, "_READ_TIMEOUT", SLOW_POLL)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed ``sock`` (end of stream) within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False


async def test_idle_connections_are_bounded_and_a_probe_is_still_answered(
    slow_deadline: None, sockets: list[socket.socket]
) -> None:
    # Each connection that sent nothing was held until the read deadline, however many there
    # were: enough of them used up the worker's file descriptors, its database connections
    # included.
    server = ProbeServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok")})
    await server.start()
    extra = 10
    try:

        def connect() -> None:
            for _ in range(_http._MAX_CLIENTS + extra):
                sockets.append(socket.create_connection(("127.0.0.1", server.port)))

        await asyncio.to_thread(connect)
        # Accepted in order: by the time this one is answered, every idle one was accepted.
        assert await asyncio.to_thread(get, server.port, "/healthz") == (200, "ok\n")
        oldest, newest = sockets[: extra + 1], sockets[-(_http._MAX_CLIENTS - 1):]
        for sock in oldest:
            assert await asyncio.to_thread(closed_by_peer, sock, PATIENCE)
        assert all(still_open(sock) for sock in newest)
    finally:
        await server.close()
