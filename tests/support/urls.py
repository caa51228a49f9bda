"""urls: database URLs for tests; never connects to anything.

* `libpq_url`: the same database as a plain libpq URL (``postgresql://``), for psycopg itself.
* `closed_port_url`: a PostgreSQL URL on a local port nobody listens on.
"""

from __future__ import annotations

import socket

from sqlalchemy import make_url

__all__ = ["closed_port_url", "libpq_url"]


def libpq_url(url: str) -> str:
    """The same database as a plain libpq URL (``postgresql://``), password included."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def closed_port_url() -> str:
    """A URL whose port was free a moment ago: connecting is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"
