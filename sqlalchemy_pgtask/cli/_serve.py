"""cli._serve: the listening socket and the connection limits of ``pgtask dashboard``.

uvicorn bounds neither how long a client may take to send a request head nor how many
connections it holds, so clients that connect and send nothing (or a byte a minute) would stay
until the process runs out of file descriptors, and then nobody gets a page. As the worker's
metrics server does (`sqlalchemy_pgtask.worker._http`), every connection here is bounded:

* in time: a request (its head and its body) must be complete `head_timeout` seconds after
  the connection was made or its previous response was sent, and a kept-alive connection with
  nothing to do is closed after `KEEP_ALIVE` seconds (uvicorn's own timer);
* in size: a head larger than `HEAD_LIMIT` is refused (h11's limit, set here explicitly);
* in count: at most `connection_cap` connections are open; one more closes the oldest that is
  not answering a request it received whole, or is closed itself if every one is. The cap
  stays below the file descriptor limit (raised to the hard limit first), so the listening
  socket and the database pool always have descriptors left and a new visitor is accepted.

The sockets are bound here, one for every address the host resolves to, before uvicorn starts,
so an address in use or a host that does not resolve is an `OSError` the command reports in
one line, rather than uvicorn's log and exit 3.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
from typing import Any, ClassVar, Final

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "BACKLOG",
    "HEAD_LIMIT",
    "KEEP_ALIVE",
    "bind",
    "connection_cap",
    "limited_protocol",
]

#: Seconds a kept-alive connection may wait for its next request.
KEEP_ALIVE: Final = 5
HEAD_LIMIT: Final = 16 * 1024
#: The listen queue, which is also how many connections asyncio accepts in one go before any
#: of them is counted; the descriptors they take are kept in reserve below the limit.
BACKLOG: Final = 32
#: Descriptors kept for everything but clients: the interpreter's own files, the event loop,
#: the database pool, log files.
_RESERVED: Final = 64
_MOST_CONNECTIONS: Final = 1024
_FEWEST_CONNECTIONS: Final = 8


def connection_cap() -> int:
    """Raise the soft descriptor limit to the hard one; how many clients may then be open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (OSError, ValueError):
            pass  # some sandboxes refuse: the cap follows the limit there is
    if soft == resource.RLIM_INFINITY:
        soft = wanted
    # Evicted connections release their descriptor on the next loop iteration, and a burst
    # of accepts takes up to BACKLOG before any is counted: keep room for both.
    free = soft - _RESERVED - 2 * BACKLOG
    return max(_FEWEST_CONNECTIONS, min(_MOST_CONNECTIONS, free))


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on every address ``host`` resolves to (``""``: every interface), as
    uvicorn's own binding (asyncio's ``create_server``) listens: ``localhost`` on both
    ``127.0.0.1`` and ``::1`` where it names both, so a browser trying either finds the
    dashboard. An address of a family the host has not enabled is passed over, as asyncio
    does; any other failure is the command's.

    :raises OSError: the host does not resolve, or one of its addresses cannot be listened on
        (in use, not local, no permission); the message names the host and port.
    """
    where = f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(f"cannot serve the dashboard on {where}: {exc.strerror}") from exc
    listeners: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    skipped: OSError | None = None
    try:
        for family, kind, proto, _, address in addresses:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            listener = socket.socket(family, kind, proto)
            listeners.append(listener)
            # As uvicorn does: a restart may bind while the last run's connections linger.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # Else "::" would take the IPv4 port too, and "0.0.0.0" beside it would fail.
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                listener.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL or len(addresses) == 1:
                    raise OSError(
                        f"cannot serve the dashboard on {where}: {exc.strerror}"
                    ) from exc
                skipped = exc  # a family this host has not enabled (asyncio's bpo-30945)
                listeners.pop().close()
                continue
            listener.listen(BACKLOG)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    if not listeners:
        reason = skipped.strerror if skipped is not None else "no address"
        raise OSError(f"cannot serve the dashboard on {where}: {reason}")
    return listeners


class _LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request and a shared cap on open
    connections; `limited_protocol` makes a subclass holding the settings and the register."""

    head_timeout: ClassVar[float] = 10.0
    cap: ClassVar[int] = _MOST_CONNECTIONS
    #: The open connections, oldest first (a dict keeps insertion order).
    open: ClassVar[dict[_LimitedH11, None]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.open) >= self.cap:
            idle = next((other for other in self.open if not other._busy()), None)
            if idle is None:
                transport.close()  # every one is being answered: none waits for this one
                return
            del self.open[idle]
            idle._close()
        self.open[self] = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open.pop(self, None)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _busy(self) -> bool:
        """Whether a request is being answered: received whole (head and body), its response
        not sent. A body that never ends would otherwise hold the connection as surely as a
        head that never ends."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and not cycle.more_body

    def _watch(self) -> None:
        if self._busy():
            self._disarm()
        elif self._head_timer is None:
            self._arm()  # waiting for a head again; the wait counts from its start, not data

    def _arm(self) -> None:
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self._busy():
            self._close()

    def _close(self) -> None:
        self.open.pop(self, None)
        self._disarm()
        self.transport.close()


def limited_protocol(head_timeout: float, cap: int) -> type[H11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``, with its own register."""
    return type(
        "LimitedH11",
        (_LimitedH11,),
        {"head_timeout": head_timeout, "cap": cap, "open": {}},
    )
