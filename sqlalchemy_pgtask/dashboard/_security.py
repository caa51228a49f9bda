"""dashboard._security: who may act (the admin token, or the host application's own hook) and
the CSRF check on every POST; decides, never writes to the database.

Three ways to be an admin, checked in this order:

* the host application's ``actor_from_request(request)`` hook returns an actor (its own auth,
  when the dashboard is mounted inside it);
* an ``Authorization: Bearer <token>`` header carrying the admin token;
* the session cookie the login form sets: the operator's name, the time of the login and a
  random session id, with an HMAC of these and of the browser's CSRF token keyed by the
  token, so the cookie proves the token was known without holding it, expires
  `Guard.session_max_age` seconds after the login, changing the token logs everyone out, and
  the session counts only beside the CSRF cookie it was issued with. The session id must
  also be one this process issued and has not revoked (`Sessions`): logging out ends the
  session on the server, so a copy of the cookie stops acting too; sessions are per process
  (a restart logs everyone out, and several processes do not share them).

Tokens and MACs are compared with `hmac.compare_digest` (constant time), and wrong tokens
are counted per client address: too many, and the address's next ones are not even checked
(`_throttle`). Every POST, login included, must carry the CSRF token: a random value in an
HttpOnly, SameSite=Strict cookie that the page repeats in a hidden form field (double
submit). A cross-site form can send the cookie (SameSite aside) but cannot read it, so it
cannot fill in the field. Whoever can plant a cookie on the dashboard's host (a sibling
subdomain, a man in the middle of plain HTTP) could choose both before the login; so the
login issues a fresh CSRF token (never the one the browser brought) and binds the session
to it. Over HTTPS both cookies carry the ``__Host-`` prefix (Secure, ``Path=/``, no
Domain), which a sibling subdomain or a plain-HTTP page cannot set at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from starlette.requests import Request
from starlette.responses import Response

from sqlalchemy_pgtask.dashboard._throttle import Throttle, Throttled

__all__ = [
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "HOST_PREFIX",
    "SESSION_COOKIE",
    "SESSION_MAX_AGE",
    "SESSION_MAX_AGE_MAX",
    "SESSION_MAX_AGE_MIN",
    "ActorHook",
    "Guard",
    "Sessions",
    "check_operator_name",
    "cookie_name",
]

CSRF_COOKIE: Final = "pgtask_csrf"
CSRF_FIELD: Final = "csrf_token"
SESSION_COOKIE: Final = "pgtask_session"
#: Over HTTPS the cookies' names carry this prefix, which browsers accept only on a Secure
#: cookie with ``Path=/`` and no Domain: no other host, nor plain HTTP, can set one.
HOST_PREFIX: Final = "__Host-"

#: The host application's auth: the actor to record for this request, or None (not allowed).
ActorHook = Callable[[Request], "str | None"]

#: An operator's name at login: recorded as ``dashboard:<name>``.
_NAME: Final = re.compile(r"[A-Za-z0-9._@+-]{1,64}")
_SESSION_CONTEXT: Final = b"sqlalchemy-pgtask dashboard session v4\x00"
#: How long a login lasts unless ``create_app`` is told otherwise: a working day; and what it
#: accepts (browsers keep a cookie 400 days at most).
SESSION_MAX_AGE: Final = 12 * 3600
SESSION_MAX_AGE_MIN: Final = 60
SESSION_MAX_AGE_MAX: Final = 400 * 86400
#: A login stamped this far ahead of this host's clock still counts (hosts' clocks differ).
_CLOCK_SKEW: Final = 300
_STAMP: Final = re.compile(r"[0-9]{1,12}")
_SESSION_ID: Final = re.compile(r"[A-Za-z0-9_-]{22}")
_CSRF_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]{43}")


def check_operator_name(name: str) -> str | None:
    """The name if it is 1 to 64 letters, digits or ``._@+-``; else None."""
    return name if _NAME.fullmatch(name) else None


def _https(request: Request) -> bool:
    return request.url.scheme == "https"


def cookie_name(request: Request, name: str) -> str:
    """``name`` as this request's cookies carry it: ``__Host-`` prefixed over HTTPS (a
    cookie of the plain name is then ignored: anyone could have planted it)."""
    return HOST_PREFIX + name if _https(request) else name


def _cookie_path(request: Request) -> str:
    """Over HTTP, cookies are scoped to the dashboard's own prefix when it is mounted; a
    ``__Host-`` cookie must have ``Path=/``."""
    if _https(request):
        return "/"
    root = str(request.scope.get("root_path") or "")
    return root.rstrip("/") + "/"


class Sessions:
    """The session ids this process issued and has not revoked, each with when it expires.

    In memory: a restart logs everyone out, and processes serving the same dashboard do not
    share it (a login counts only on the process that issued it).
    """

    def __init__(self) -> None:
        self._live: dict[str, float] = {}

    def issue(self, expires_at: float) -> str:
        now = time.time()
        for stale in [sid for sid, end in self._live.items() if end <= now]:
            del self._live[stale]
        sid = secrets.token_urlsafe(16)
        self._live[sid] = expires_at
        return sid

    def live(self, sid: str) -> bool:
        end = self._live.get(sid)
        return end is not None and time.time() < end

    def revoke(self, sid: str) -> None:
        self._live.pop(sid, None)


@dataclass(frozen=True)
class Guard:
    """The dashboard's access rules: read-only unless a token or a hook is configured."""

    admin_token: str | None
    actor_from_request: ActorHook | None
    #: Seconds a login's session cookie is accepted for (and kept by the browser).
    session_max_age: int = SESSION_MAX_AGE
    #: Wrong tokens per client address (`sqlalchemy_pgtask.dashboard._throttle`).
    throttle: Throttle = field(default_factory=Throttle, compare=False)
    #: The live sessions: logging out revokes one.
    sessions: Sessions = field(default_factory=Sessions, compare=False)

    @property
    def actions_possible(self) -> bool:
        """Whether any request could ever act (else the dashboard is read-only)."""
        return self.admin_token is not None or self.actor_from_request is not None

    # -- the admin ------------------------------------------------------------------------

    def _mac(self, name: str, issued: str, sid: str, csrf: str) -> str:
        assert self.admin_token is not None
        key = hashlib.sha256(_SESSION_CONTEXT + self.admin_token.encode("utf-8")).digest()
        message = f"{name}\x00{issued}\x00{sid}\x00{csrf}".encode()
        return hmac.new(key, message, hashlib.sha256).hexdigest()

    def session_value(self, name: str, issued_at: float, csrf: str) -> str:
        """A new live session's cookie value for ``name`` logged in at ``issued_at`` (Unix
        time) in a browser whose CSRF cookie is ``csrf``."""
        issued = str(int(issued_at))
        sid = self.sessions.issue(int(issued_at) + self.session_max_age)
        return f"{name}:{issued}:{sid}:{self._mac(name, issued, sid, csrf)}"

    def token_matches(self, candidate: str) -> bool:
        """Whether ``candidate`` is the admin token (constant time; False if none is set)."""
        if self.admin_token is None:
            return False
        return hmac.compare_digest(candidate.encode("utf-8"), self.admin_token.encode("utf-8"))

    def guess(self, request: Request, candidate: object) -> bool:
        """Whether the token ``request`` offers is the admin token; a wrong one counts against
        the request's address. Raises `Throttled`, checking nothing, when the address has
        failed too often."""
        # A request is asked who it is more than once (the action, then the page it gets):
        # each token it offers counts once.
        guessed: dict[object, bool] | None = getattr(request.state, "token_guesses", None)
        if guessed is None:
            guessed = request.state.token_guesses = {}
        if candidate in guessed:
            return guessed[candidate]
        address = request.client.host if request.client is not None else ""
        self.throttle.check(address)
        right = isinstance(candidate, str) and self.token_matches(candidate)
        if right:
            self.throttle.succeeded(address)
        else:
            self.throttle.failed(address)
        guessed[candidate] = right
        return right

    def _session(self, cookie: str, csrf: str) -> tuple[str, str] | None:
        """The operator's name and the session id of a genuine, unexpired session cookie
        (revoked or not), or None."""
        parts = cookie.split(":")
        if len(parts) != 4 or self.admin_token is None:
            return None
        name, issued, sid, mac = parts
        if (not check_operator_name(name) or not _STAMP.fullmatch(issued)
                or not _SESSION_ID.fullmatch(sid) or not csrf):
            return None
        # Bytes, not str: compare_digest refuses non-ASCII str (a forged cookie may hold any
        # byte), which would make a refusal a server error.
        expected = self._mac(name, issued, sid, csrf).encode()
        if not hmac.compare_digest(mac.encode("utf-8"), expected):
            return None
        age = time.time() - int(issued)
        if not -_CLOCK_SKEW <= age <= self.session_max_age:
            return None
        return name, sid

    def _cookies(self, request: Request) -> tuple[str, str]:
        return (request.cookies.get(cookie_name(request, SESSION_COOKIE), ""),
                request.cookies.get(cookie_name(request, CSRF_COOKIE), ""))

    def _session_actor(self, request: Request) -> str | None:
        session = self._session(*self._cookies(request))
        if session is None or not self.sessions.live(session[1]):
            return None
        return f"dashboard:{session[0]}"

    def actor(self, request: Request) -> str | None:
        """The actor this request may act as, or None: it may only look."""
        if self.actor_from_request is not None:
            actor = self.actor_from_request(request)
            if actor is not None:
                return actor
        if self.admin_token is None:
            return None
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            with contextlib.suppress(Throttled):  # throttled: the token counts for nothing
                if self.guess(request, credentials.strip()):
                    return "dashboard:token"
        return self._session_actor(request)

    def _revoke(self, request: Request) -> None:
        session = self._session(*self._cookies(request))
        if session is not None:
            self.sessions.revoke(session[1])

    def log_in(self, request: Request, response: Response, name: str) -> None:
        """Start a new session for ``name`` (the token and the CSRF field were checked by the
        caller): a fresh CSRF token and session id, never the CSRF cookie the browser
        brought, which someone else may have planted. The CSRF cookie lasts as long as the
        session: a browser that dropped it would be logged out. A session the browser
        already had ends."""
        self._revoke(request)
        csrf = secrets.token_urlsafe(32)
        for cookie, value in (
            (SESSION_COOKIE, self.session_value(name, time.time(), csrf)), (CSRF_COOKIE, csrf)
        ):
            response.set_cookie(
                cookie_name(request, cookie), value, max_age=self.session_max_age,
                path=_cookie_path(request), httponly=True, samesite="strict",
                secure=_https(request),
            )

    def log_out(self, request: Request, response: Response) -> None:
        """End the request's session on the server (a copy of its cookie stops acting too),
        and remove the cookie."""
        self._revoke(request)
        response.delete_cookie(
            cookie_name(request, SESSION_COOKIE), path=_cookie_path(request), httponly=True,
            samesite="strict", secure=_https(request),
        )

    # -- CSRF -------------------------------------------------------------------------------

    @staticmethod
    def csrf_token(request: Request) -> str:
        """The request's CSRF token: the cookie's, or a new one `set_csrf_cookie` will send."""
        token = request.cookies.get(cookie_name(request, CSRF_COOKIE))
        if token is None or not _CSRF_TOKEN.fullmatch(token):
            token = request.state.new_csrf_token = getattr(
                request.state, "new_csrf_token", None
            ) or secrets.token_urlsafe(32)
        return token

    @staticmethod
    def set_csrf_cookie(request: Request, response: Response) -> None:
        """Send the CSRF cookie if this request minted a new token."""
        token = getattr(request.state, "new_csrf_token", None)
        if token is not None:
            response.set_cookie(
                cookie_name(request, CSRF_COOKIE), token, path=_cookie_path(request),
                httponly=True, samesite="strict", secure=_https(request),
            )

    @staticmethod
    def csrf_valid(request: Request, submitted: object) -> bool:
        """Whether the form's token equals the cookie's (constant time)."""
        cookie = request.cookies.get(cookie_name(request, CSRF_COOKIE))
        if not cookie or not isinstance(submitted, str) or not submitted:
            return False
        return hmac.compare_digest(cookie.encode("utf-8"), submitted.encode("utf-8"))
