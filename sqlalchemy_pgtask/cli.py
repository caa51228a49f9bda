"""cli: the ``pgtask`` command; parses arguments and reports errors, holding no logic of its own.

Exit codes: 0 success, 1 an operational failure (database unreachable, schema missing), 2 a
usage error (bad arguments or URL). User mistakes print one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from alembic.util import CommandError
from sqlalchemy import Connection, create_engine, make_url, select
from sqlalchemy.exc import ArgumentError, OperationalError

from sqlalchemy_pgtask import __version__, statements
from sqlalchemy_pgtask.errors import (
    PgTaskError,
    SchemaNotInstalled,
    TaskNotFound,
    ValidationError,
)
from sqlalchemy_pgtask.models import Attempt, Queue, Task
from sqlalchemy_pgtask.registry import Registry

__all__ = ["main"]

URL_ENV = "PGTASK_DATABASE_URL"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    """A mistake in how the command was called."""


def _database_url(args: argparse.Namespace) -> str:
    raw = args.database_url or os.environ.get(URL_ENV)
    if not raw:
        raise _UsageError(f"no database URL: pass --database-url or set {URL_ENV}")
    try:
        url = make_url(raw)
    except ArgumentError as exc:
        raise _UsageError(f"invalid database URL {raw!r}: {exc}") from exc
    if url.get_backend_name() != "postgresql":
        raise _UsageError(f"pgtask needs PostgreSQL, got a {url.get_backend_name()!r} URL")
    # The library speaks psycopg 3; accept plain postgresql:// and other drivers' URLs.
    return url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def _migrate(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.migrations import upgrade

    upgrade(_database_url(args), args.revision)
    print(f"pgtask schema is at {args.revision}")
    return EXIT_OK


def _init_alembic(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.alembic_env import init_alembic_env

    init_alembic_env(args.directory, config_path=args.config)
    return EXIT_OK


def _load_registry(target: str) -> Registry:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise _UsageError(f"expected MODULE:ATTRIBUTE (e.g. app.tasks:registry), got {target!r}")
    # Like uvicorn and celery: the current directory's modules are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise _UsageError(f"cannot import module {module_name!r}: {exc}") from exc
        raise _UsageError(f"importing {module_name!r} failed: {exc!r}") from exc
    except Exception as exc:
        raise _UsageError(f"importing {module_name!r} failed: {exc!r}") from exc
    registry = getattr(module, attribute, None)
    if registry is None:
        raise _UsageError(f"module {module_name!r} has no attribute {attribute!r}")
    if not isinstance(registry, Registry):
        raise _UsageError(
            f"{target} is a {type(registry).__name__}, not a sqlalchemy_pgtask.Registry"
        )
    return registry


def _worker(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.worker import WorkerOptions, run

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    registry = _load_registry(args.registry)
    options = WorkerOptions(
        queues=tuple(args.queue) if args.queue else None,
        concurrency=args.concurrency,
        lease_duration=args.lease_duration,
        shutdown_grace=args.shutdown_grace,
        poll_interval=args.poll_interval,
    )
    # First signal: drain; second: hand back what runs and stop now; later ones: ignored
    # until the process has exited.
    run(registry, _database_url(args), options, restore_signals=False)
    return EXIT_OK


def _with_connection(args: argparse.Namespace, action: Callable[[Connection], int]) -> int:
    engine = create_engine(_database_url(args))
    try:
        with engine.connect() as connection:
            if not connection.execute(statements.SCHEMA_INSTALLED).scalar_one():
                raise SchemaNotInstalled()
            code = action(connection)
            connection.commit()
            return code
    finally:
        engine.dispose()


def _status(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask import status

    def show(connection: Connection) -> int:
        workers = status.live_workers(connection)
        print(f"live workers: {len(workers)}")
        for w in workers:
            flag = " (draining)" if w.draining else ""
            print(
                f"  {w.id}  {w.hostname} pid {w.pid}  queues {','.join(w.queues)}  "
                f"concurrency {w.concurrency}  heartbeat {w.heartbeat_age_seconds:.1f}s ago{flag}"
            )
        counts = status.queue_counts(connection)
        print("queues:" if counts else "queues: no outstanding tasks")
        for c in counts:
            print(
                f"  {c.queue}: {c.pending} pending ({c.due} due), {c.running} running, "
                f"{c.waiting} waiting"
            )
        stuck = status.unroutable(connection)
        if stuck:
            print("pending tasks no live worker can run:")
            for u in stuck:
                print(f"  {u.queue} {u.name} v{u.version}: {u.count}")
        return EXIT_OK

    return _with_connection(args, show)


def _task_show(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.client import _task_id

    task_id = _task_id(args.task_id)

    def show(connection: Connection) -> int:
        tasks, attempts = Task.__table__, Attempt.__table__
        row = connection.execute(select(tasks).where(tasks.c.id == task_id)).mappings().first()
        if row is None:
            raise TaskNotFound(f"no task with id {task_id}")
        for column in tasks.columns:
            print(f"{column.name:>20}: {row[column]}")
        history = connection.execute(
            select(attempts).where(attempts.c.task_id == task_id).order_by(attempts.c.attempt)
        )
        for attempt in history:
            error = f"  {attempt.error}" if attempt.error else ""
            print(
                f"  attempt {attempt.attempt}: {attempt.state} by worker {attempt.worker_id} "
                f"at {attempt.started_at}{error}"
            )
        return EXIT_OK

    return _with_connection(args, show)


def _task_cancel(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.client import cancel

    def run(connection: Connection) -> int:
        state = cancel(connection, args.task_id)
        if state is None:
            raise TaskNotFound(f"task {args.task_id} does not exist or has already finished")
        if state == "running":
            print(f"task {args.task_id}: cancellation requested; its worker will stop it")
        else:
            print(f"task {args.task_id}: {state}")
        return EXIT_OK

    return _with_connection(args, run)


def _queue_set(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.client import configure_queue

    options: dict[str, Any] = {}
    if args.no_capacity:
        options["max_outstanding_tasks"] = None
    elif args.capacity is not None:
        options["max_outstanding_tasks"] = args.capacity
    if args.paused is not None:
        options["paused"] = args.paused
    if args.terminal_retention is not None:
        options["terminal_retention_seconds"] = args.terminal_retention
    if args.idempotency_retention is not None:
        options["idempotency_retention_seconds"] = args.idempotency_retention

    def run(connection: Connection) -> int:
        row = configure_queue(connection, args.name, **options)
        _print_queue(row)
        return EXIT_OK

    return _with_connection(args, run)


def _print_queue(row: Mapping[str, Any]) -> None:
    capacity = row["max_outstanding_tasks"]
    limit = "unlimited" if capacity is None else f"{row['outstanding_tasks']}/{capacity}"
    paused = f"paused since {row['paused_at']}" if row["paused_at"] else "active"
    print(
        f"{row['name']}: {paused}, capacity {limit}, terminal retention "
        f"{row['terminal_retention_seconds']}s, idempotency retention "
        f"{row['idempotency_retention_seconds']}s"
    )


def _queue_list(args: argparse.Namespace) -> int:
    def run(connection: Connection) -> int:
        queues = Queue.__table__
        rows = connection.execute(select(queues).order_by(queues.c.name)).mappings().all()
        if not rows:
            print("no queue has settings; every queue uses the defaults")
        for row in rows:
            _print_queue(dict(row))
        return EXIT_OK

    return _with_connection(args, run)


def _demo(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.demo import run_demo

    return run_demo(timeout=args.timeout)


def _add_url_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help=f"PostgreSQL URL, e.g. postgresql://user@host/db (default: ${URL_ENV})",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgtask",
        description="Durable tasks and workflows inside PostgreSQL.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    migrate = commands.add_parser(
        "migrate",
        help="install or upgrade the pgtask schema (without an Alembic environment)",
        description=(
            "Apply pgtask's Alembic revisions. Records the applied revision in "
            "pgtask.alembic_version. If your application has its own Alembic environment, "
            "use `alembic upgrade heads` there instead (see docs/alembic.md)."
        ),
    )
    _add_url_option(migrate)
    migrate.add_argument(
        "--revision", default="pgtask@head", help="target revision (default: pgtask@head)"
    )
    migrate.set_defaults(handler=_migrate)

    init = commands.add_parser(
        "init-alembic",
        help="create an Alembic environment that includes pgtask's revisions",
        description=(
            "Create a new Alembic environment in DIRECTORY whose version_locations include "
            "pgtask's revisions and whose autogenerate ignores nothing it should compare."
        ),
    )
    init.add_argument(
        "directory", help="the new environment's directory (absent or empty)"
    )
    init.add_argument(
        "--config", default="alembic.ini", help="path of the alembic.ini to write"
    )
    init.set_defaults(handler=_init_alembic)

    worker = commands.add_parser(
        "worker",
        help="run a worker for the handlers of a registry",
        description=(
            "Claim and run tasks for the handlers registered in MODULE:ATTRIBUTE. SIGTERM or "
            "SIGINT stops claiming and lets running handlers finish within the grace period; "
            "a second signal hands their tasks back at once."
        ),
    )
    worker.add_argument("registry", metavar="MODULE:ATTRIBUTE", help="e.g. app.tasks:registry")
    _add_url_option(worker)
    worker.add_argument(
        "--queue", action="append", metavar="QUEUE",
        help="a queue to serve; repeat for several, earlier first (default: all registered)",
    )
    worker.add_argument("--concurrency", type=int, default=10, help="handlers at once (10)")
    worker.add_argument(
        "--lease-duration", type=float, default=30.0, metavar="SECONDS",
        help="lease length, renewed every third of it (30)",
    )
    worker.add_argument(
        "--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
        help="time running handlers get to finish after a shutdown signal (30)",
    )
    worker.add_argument(
        "--poll-interval", type=float, default=30.0, metavar="SECONDS",
        help="longest idle sleep without a notification (30)",
    )
    worker.add_argument(
        "--log-level", default="info",
        choices=["debug", "info", "warning", "error"], help="(info)",
    )
    worker.set_defaults(handler=_worker)

    status_parser = commands.add_parser(
        "status", help="live workers, outstanding tasks, and work no live worker can run"
    )
    _add_url_option(status_parser)
    status_parser.set_defaults(handler=_status)

    task = commands.add_parser("task", help="inspect or cancel one task")
    task_commands = task.add_subparsers(dest="task_command", metavar="ACTION", required=True)
    show = task_commands.add_parser("show", help="print a task and its attempts")
    show.add_argument("task_id", metavar="TASK_ID")
    _add_url_option(show)
    show.set_defaults(handler=_task_show)
    cancel_parser = task_commands.add_parser("cancel", help="cancel a task")
    cancel_parser.add_argument("task_id", metavar="TASK_ID")
    _add_url_option(cancel_parser)
    cancel_parser.set_defaults(handler=_task_cancel)

    queue = commands.add_parser("queue", help="list or change queue settings")
    queue_commands = queue.add_subparsers(dest="queue_command", metavar="ACTION", required=True)
    queue_list = queue_commands.add_parser("list", help="queues with settings")
    _add_url_option(queue_list)
    queue_list.set_defaults(handler=_queue_list)
    queue_set = queue_commands.add_parser(
        "set", help="create or change a queue's settings (only the options given change)"
    )
    queue_set.add_argument("name", metavar="QUEUE")
    capacity = queue_set.add_mutually_exclusive_group()
    capacity.add_argument(
        "--capacity", type=int, metavar="N", help="most pending + running + waiting tasks"
    )
    capacity.add_argument("--no-capacity", action="store_true", help="remove the limit")
    pause = queue_set.add_mutually_exclusive_group()
    pause.add_argument("--pause", dest="paused", action="store_const", const=True,
                       help="stop claims (enqueues still accepted)")
    pause.add_argument("--resume", dest="paused", action="store_const", const=False)
    queue_set.add_argument("--terminal-retention", type=int, metavar="SECONDS")
    queue_set.add_argument("--idempotency-retention", type=int, metavar="SECONDS")
    _add_url_option(queue_set)
    queue_set.set_defaults(handler=_queue_set, paused=None)

    demo = commands.add_parser(
        "demo",
        help="enqueue in a real transaction and run a worker, on an embedded PostgreSQL",
        description=(
            "Uses $PGTASK_DATABASE_URL if set (a throwaway database is created there and "
            "dropped), else starts an embedded PostgreSQL."
        ),
    )
    demo.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (60)")
    demo.set_defaults(handler=_demo)
    return parser


def _fail(code: int, message: str) -> NoReturn:
    print(f"pgtask: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pgtask`` command line and return its exit code."""
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (_UsageError, CommandError) as exc:
        _fail(EXIT_USAGE, str(exc))
    except ValidationError as exc:
        _fail(EXIT_USAGE, str(exc))
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        _fail(EXIT_FAILURE, f"cannot reach the database: {reason}")
    except PgTaskError as exc:
        _fail(EXIT_FAILURE, str(exc))
    except KeyboardInterrupt:
        _fail(130, "interrupted")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
