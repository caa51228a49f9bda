"""_url: database URLs as libpq writes them, multi-host failover lists included; no I/O.

libpq (and so psycopg) takes ``postgresql://user@h1:5432,h2:5432/db?target_session_attrs=
read-write``: it tries the hosts in order and keeps the first that has the session attributes
asked for, which is how a client follows a failover. SQLAlchemy's `make_url` reads the whole
``h1:5432,h2:5432`` as one host and its port (``int("5432,h2:5432")``: a bare ValueError),
but its PostgreSQL dialects take the same list as query parameters, ``?host=h1,h2&port=5432,
5432``, and hand it to the driver as libpq's ``host`` and ``port`` lists. `database_url`
rewrites the first form into the second, so every place the library takes a URL (the worker,
the command line, the dashboard, the demo, the test fixtures) accepts both.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Final

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError

from sqlalchemy_pgtask.errors import InvalidOptionError

__all__ = ["database_url", "parse", "redacted"]

#: ``scheme://[userinfo@]hosts[/database][?query]``: the userinfo reaches the last ``@`` before
#: the first ``/`` or ``?`` (an unencoded password may hold an ``@``, never a ``/`` or ``?``,
#: which RFC 3986 leaves to the path and query: an ``@`` there, as in
#: ``?application_name=a@b``, is the query's); the host list holds none of ``/?@``.
_AUTHORITY: Final = re.compile(
    r"^(?P<scheme>[\w+.-]+)://(?:(?P<userinfo>[^/?]*)@)?(?P<hosts>[^/?@]*)(?P<rest>[/?].*)?$",
    re.DOTALL,
)
#: One entry of a host list: ``host``, ``host:port``, ``[ipv6]`` or ``[ipv6]:port``.
_HOST: Final = re.compile(r"^(?:\[(?P<ipv6>[^\]]*)\]|(?P<name>[^:\[\]]*))(?::(?P<port>[^:]*))?$")
#: The password of a URL that did not parse (so SQLAlchemy cannot hide it): all up to the
#: last ``@``. Hiding too much of a broken URL is harmless; echoing part of a password is not.
_PASSWORD: Final = re.compile(r"(://[^:/@]*:).*@")


def redacted(raw: str) -> str:
    """``raw`` with any password replaced by ``***``, for error messages."""
    return _PASSWORD.sub(r"\1***@", raw)


def database_url(url: str | URL, field: str = "database") -> URL:
    """``url`` as a SQLAlchemy `URL` of the psycopg 3 driver; libpq's host lists accepted.

    ``postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write`` becomes
    ``postgresql+psycopg://u@/db?host=h1,h2&port=5432,5433&target_session_attrs=read-write``,
    which SQLAlchemy passes to psycopg as the same libpq host and port lists. Any PostgreSQL
    driver name is accepted (the library speaks psycopg 3); ``postgres://`` too.

    :raises InvalidOptionError: (naming ``field``) not a URL, not a PostgreSQL one, a port
        that is not a number, a host list that is also given as ``?host=``.
    """
    if not isinstance(url, (str, URL)):
        raise InvalidOptionError(field, f"must be a URL, got {type(url).__name__}")
    try:
        parsed = parse(url)
    except ValueError as exc:
        shown = redacted(url) if isinstance(url, str) else repr(url)
        raise InvalidOptionError(field, f"{shown!r} is not a database URL: {exc}") from None
    if parsed.get_backend_name() not in ("postgresql", "postgres"):  # postgres:// as Heroku has it
        raise InvalidOptionError(
            field, f"must be a PostgreSQL URL, got a {parsed.get_backend_name()!r} one"
        )
    return parsed.set(drivername="postgresql+psycopg")


def parse(url: str | URL) -> URL:
    """``url`` as SQLAlchemy reads it, a libpq host list moved into the query; any dialect.

    :raises ValueError: it does not parse (SQLAlchemy's `ArgumentError` included), or a
        port is not a number from 1 to 65535.
    """
    try:
        parsed = _with_host_list(url) if isinstance(url, str) else url
        if parsed is None:
            parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(str(exc)) from None
    # make_url's own int() of the port raises ValueError (postgresql://u@h:abc/db) itself.
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"port {parsed.port} is out of range")
    return parsed


def _with_host_list(raw: str) -> URL | None:
    """``raw`` with its libpq host list moved into the query; None if it names one host."""
    match = _AUTHORITY.match(raw.strip())
    if match is None or "," not in match["hosts"]:
        return None
    hosts: list[str] = []
    ports: list[str] = []
    for entry in match["hosts"].split(","):
        part = _HOST.match(entry)
        if part is None:
            raise ValueError(f"host {entry!r} of the host list is not host[:port]")
        port = part["port"] or ""
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"port {port!r} of host {entry!r} is not a port number")
        hosts.append(urllib.parse.unquote(part["ipv6"] or part["name"] or ""))
        ports.append(port)
    # make_url reads the userinfo only up to its first '@', and without a path up to an '@'
    # of the query: the userinfo goes percent-encoded, and the query after a '/'.
    userinfo = "" if match["userinfo"] is None else _encoded(match["userinfo"]) + "@"
    rest = match["rest"] or ""
    url = make_url(f"{match['scheme']}://{userinfo}{'/' if rest[:1] == '?' else ''}{rest}")
    if "host" in url.query or "port" in url.query:
        raise ValueError("hosts are given both before the database name and as ?host= or ?port=")
    query = {"host": ",".join(hosts)}
    if any(ports):
        query["port"] = ",".join(ports)  # an empty entry: that host's default port
    return url.update_query_dict(query)


def _encoded(userinfo: str) -> str:
    """``user[:password]`` with each part percent-encoded (as it reads, decoded first)."""
    user, colon, password = userinfo.partition(":")
    parts = [urllib.parse.quote(urllib.parse.unquote(part), safe="") for part in (user, password)]
    return parts[0] + (f":{parts[1]}" if colon else "")
