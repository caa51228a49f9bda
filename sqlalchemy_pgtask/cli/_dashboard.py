"""cli._dashboard: ``pgtask dashboard``: serve the web dashboard with uvicorn; holds no logic of
its own (the application is `sqlalchemy_pgtask.dashboard.create_app`).

The admin token comes from ``--admin-token`` or ``$PGTASK_DASHBOARD_TOKEN``; prefer the
variable, since a command line is visible to every user of the host (``ps``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any, Final

from sqlalchemy import create_engine

from sqlalchemy_pgtask import status
from sqlalchemy_pgtask.cli._connection import URL_ENV, database_url
from sqlalchemy_pgtask.cli._errors import EXIT_OK, UsageError
from sqlalchemy_pgtask.cli._types import int_between, positive_seconds
from sqlalchemy_pgtask.errors import SchemaNotInstalled

__all__ = ["TOKEN_ENV", "add_commands", "dashboard"]

TOKEN_ENV: Final = "PGTASK_DASHBOARD_TOKEN"  # noqa: S105 - a variable name, not a secret
_INSTALL: Final = 'pip install "sqlalchemy-pgtask[dashboard]"'
#: Import names of the extra's packages.
_NEEDS: Final = ("starlette", "jinja2", "multipart", "uvicorn")
#: Seconds a client has to send a request, head and body (`cli._serve` bounds the rest).
_HEAD_TIMEOUT: Final = 10.0


def dashboard(args: argparse.Namespace) -> int:
    missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"the dashboard needs {', '.join(missing)}: {_INSTALL}")
    from sqlalchemy_pgtask.dashboard import create_app

    token = args.admin_token or os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < 8:
        raise UsageError("the admin token must be at least 8 characters")
    engine = create_engine(database_url(args), pool_size=4, max_overflow=4, pool_pre_ping=True)
    try:
        with _stopped_by_signal():
            with engine.connect() as connection:
                if not status.schema_installed(connection):
                    raise SchemaNotInstalled()
            options: dict[str, Any] = {} if args.session_max_age is None else {
                "session_max_age": args.session_max_age
            }
            if args.live_interval is not None:
                options["live_interval"] = args.live_interval
            try:
                app = create_app(
                    engine, admin_token=token, require_login=args.require_login, **options
                )
            except ValueError as exc:
                raise UsageError(str(exc)) from exc
            mode = "actions need the admin token" if token else "read-only: no admin token"
            _serve(app, args, mode)
    finally:
        engine.dispose()
    return EXIT_OK


def _serve(app: Any, args: argparse.Namespace, mode: str) -> None:
    import uvicorn

    from sqlalchemy_pgtask.cli import _serve as limits

    cap = limits.connection_cap()
    listeners = limits.bind(args.host, args.port)  # an OSError: one line, exit 1
    with contextlib.ExitStack() as closing:
        for listener in listeners:
            closing.enter_context(listener)
        port = listeners[0].getsockname()[1]
        print(f"pgtask dashboard on {_url(args.host, port)} ({mode})", flush=True)
        # uvicorn trusts X-Forwarded-For from loopback peers unless told otherwise: behind a
        # tunnel or a proxy that passes the client's header on, every wrong token could
        # name a fresh address and never be throttled.
        proxies = args.forwarded_allow_ips
        config = uvicorn.Config(
            app, host=args.host, port=port, log_level=args.log_level,
            proxy_headers=proxies is not None, forwarded_allow_ips=proxies,
            http=limits.limited_protocol(args.head_timeout, cap), ws="none",
            timeout_keep_alive=limits.KEEP_ALIVE, backlog=limits.BACKLOG,
            h11_max_incomplete_event_size=limits.HEAD_LIMIT,
        )
        uvicorn.Server(config).run(sockets=listeners)


def _url(host: str, port: int) -> str:
    """The address a browser would use: an IPv6 literal in brackets, every interface
    (``""``) as ``0.0.0.0``."""
    shown = f"[{host}]" if ":" in host else host or "0.0.0.0"  # noqa: S104 - shown, not bound
    return f"http://{shown}:{port}/"


class _Stop(BaseException):
    """A stop signal, raised on the main thread by `_stopped_by_signal`'s handler."""


@contextlib.contextmanager
def _stopped_by_signal() -> Iterator[None]:
    """SIGTERM and SIGINT end the block, and the command exits 0 like ``pgtask worker``.

    While it serves, uvicorn handles both itself (a graceful shutdown); once shut down, it
    raises the signal again under the handler it found (0.29 and later). The default handler
    would kill the process there (exit 143), skipping the engine's disposal and the exit code,
    so the handler installed here ends the block instead; it also ends it when the signal comes
    before uvicorn took over (while the command connects and checks the schema).
    """

    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:  # a second signal while the block unwinds changes nothing
            stopping = True
            raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except _Stop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_commands(commands: Any) -> None:
    """Add ``pgtask dashboard`` to the ``pgtask`` parser's subcommands."""
    command = commands.add_parser(
        "dashboard",
        help="serve the web dashboard (needs the 'dashboard' extra)",
        description=(
            "Serve the web dashboard: queues, tasks, workers, schedules and the audit log. "
            "Read-only unless an admin token is given; with one, an operator who logs in "
            "with it may retry, cancel, pause and resume, each written to the audit log. "
            f"Needs the extra: {_INSTALL}."
        ),
    )
    command.add_argument(
        "--database-url",
        metavar="URL",
        help=f"PostgreSQL URL, e.g. postgresql://user@host/db (default: ${URL_ENV})",
    )
    command.add_argument(
        "--host", default="127.0.0.1",
        help=(
            "host or address to listen on, every address it resolves to; \"\" for every"
            " interface (default: %(default)s)"
        ),
    )
    command.add_argument(
        "--port", type=int_between(1, 65535), default=8080,
        help="port to listen on (default: %(default)s)",
    )
    command.add_argument(
        "--admin-token", metavar="TOKEN",
        help=f"enables actions (default: ${TOKEN_ENV}; prefer the variable)",
    )
    command.add_argument(
        "--session-max-age", metavar="SECONDS", type=int_between(1, 2**31),
        help="how long a login lasts, 60 s to 400 days (default: 43200, 12 hours)",
    )
    command.add_argument(
        "--live-interval", metavar="SECONDS", type=float,
        help=(
            "seconds between live refreshes of the overview, the task list and a task's "
            "page, 1 to 3600; 0 turns live refresh off (default: 5)"
        ),
    )
    command.add_argument(
        "--require-login", action="store_true",
        help=(
            "serve nothing but the login page without the admin token (default: anyone who "
            "can reach the dashboard reads every task, payloads and tracebacks included)"
        ),
    )
    command.add_argument(
        "--forwarded-allow-ips", metavar="ADDRESSES",
        help=(
            "comma-separated addresses of the proxies whose X-Forwarded-For and "
            "X-Forwarded-Proto headers are believed (default: none, the client is the peer)"
        ),
    )
    command.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info",
        help="uvicorn's log level (default: %(default)s)",
    )
    command.add_argument(
        "--head-timeout", metavar="SECONDS", type=positive_seconds, default=_HEAD_TIMEOUT,
        help="seconds a client has to send a request, head and body (default: %(default)s)",
    )
    command.set_defaults(handler=dashboard)
