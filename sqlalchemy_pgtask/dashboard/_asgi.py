"""dashboard._asgi: what holds for every response the dashboard sends, the framework's own
included (static files, 404 and 405 answers, the 500 page): the security headers, a
``Location`` without a host, and, with ``require_login``, nothing but the login page for a
visitor without a token.

It wraps the whole Starlette application (outside Starlette's own middleware, so its error
pages get the headers too), as a subclass, so the app stays a `Starlette` to mount.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import Message, Receive, Scope, Send

from sqlalchemy_pgtask.dashboard._security import Guard

__all__ = ["SECURITY_HEADERS", "DashboardApp"]

#: On every response unless the response set its own. The pages never need to be framed, to
#: run inline script, or to load from elsewhere; nothing is to be sniffed into another type.
SECURITY_HEADERS: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
)
#: What a visitor without a token may fetch when login is required (paths under the prefix).
_OPEN_PATHS: Final = frozenset({"/login"})
_OPEN_PREFIX: Final = "/static/"


def _relative(location: bytes) -> bytes:
    """``location`` without a scheme and host: Starlette builds its redirects (a trailing
    slash) from the request's Host header, which the client chooses."""
    parts = urlsplit(location.decode("latin-1"))
    if not (parts.scheme or parts.netloc):
        return location
    path = "/" + parts.path.lstrip("/")  # never ``//host``: that is another host again
    return (path + (f"?{parts.query}" if parts.query else "")).encode("latin-1")


def _secured(send: Send) -> Send:
    async def send_secured(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [
                (name, _relative(value) if name.lower() == b"location" else value)
                for name, value in message.get("headers", [])
            ]
            present = {name.lower() for name, _ in headers}
            headers += [(name, value) for name, value in SECURITY_HEADERS if name not in present]
            message = {**message, "headers": headers}
        await send(message)

    return send_secured


class DashboardApp(Starlette):
    """The dashboard's Starlette application, wrapped as the module says."""

    guard: Guard | None = None
    require_login: bool = False

    def _refusal(self, scope: Scope) -> Response | None:
        """The answer to a visitor without a token when login is required, or None."""
        root = str(scope.get("root_path") or "").rstrip("/")
        path = str(scope.get("path") or "")
        inner = path[len(root):] if path.startswith(root) else path
        if inner in _OPEN_PATHS or inner.startswith(_OPEN_PREFIX):
            return None
        assert self.guard is not None
        if self.guard.actor(Request(scope)) is not None:
            return None
        if scope.get("method") in {"GET", "HEAD"}:
            return RedirectResponse(f"{root}/login", status_code=303)
        return PlainTextResponse("This dashboard needs a login.", status_code=401)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        send = _secured(send)
        if self.require_login:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
