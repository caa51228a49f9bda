"""The commands that set things up or run things (``migrate``, ``init-alembic``, ``worker``,
``demo``): turn arguments into library calls; hold no logic of their own.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from sqlalchemy_pgtask._logging import configure_logging
from sqlalchemy_pgtask.cli._connection import database_url
from sqlalchemy_pgtask.cli._errors import EXIT_OK, UsageError
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.worker import WorkerOptions, run

__all__ = ["demo", "init_alembic", "load_registry", "migrate", "worker"]


def migrate(args: argparse.Namespace) -> int:
    from sqlalchemy import create_engine

    from sqlalchemy_pgtask.migrations import current_revision, upgrade

    engine = create_engine(database_url(args))
    try:
        upgrade(engine, args.revision)
        # What the database records, not the target asked for: an upgrade never goes back,
        # so a target older than the applied revision changes nothing.
        with engine.connect() as connection:
            applied = current_revision(connection)
    finally:
        engine.dispose()
    print(f"pgtask schema is at {applied}")
    return EXIT_OK


def init_alembic(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.alembic_env import init_alembic_env

    init_alembic_env(args.directory, config_path=args.config)
    return EXIT_OK


def load_registry(target: str) -> Registry:
    """The `Registry` named by ``MODULE:ATTRIBUTE``; any import failure is a usage error."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"expected MODULE:ATTRIBUTE (e.g. app.tasks:registry), got {target!r}")
    # Like uvicorn and celery: the current directory's modules are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UsageError(f"cannot import module {module_name!r}: {exc}") from exc
        raise UsageError(f"importing {module_name!r} failed: {exc!r}") from exc
    except Exception as exc:  # the application's own import-time error, whatever it is
        raise UsageError(f"importing {module_name!r} failed: {exc!r}") from exc
    registry = getattr(module, attribute, None)
    if registry is None:
        raise UsageError(f"module {module_name!r} has no attribute {attribute!r}")
    if not isinstance(registry, Registry):
        raise UsageError(
            f"{target} is a {type(registry).__name__}, not a sqlalchemy_pgtask.Registry"
        )
    return registry


def worker(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    url = database_url(args)
    registry = load_registry(args.registry)
    options = WorkerOptions(
        queues=tuple(args.queue) if args.queue else None,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        lease_duration=args.lease_duration,
        shutdown_grace=args.shutdown_grace,
        poll_interval=args.poll_interval,
        instant_rescue=args.instant_rescue,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_interval=args.metrics_interval,
        health_timeout=args.health_timeout,
        on_stuck_handler=args.on_stuck_handler,
    )
    # First signal: drain; second: hand back what runs and stop now; later ones are ignored
    # until the process has exited, so a late signal cannot turn a clean exit into 143/130.
    run(registry, url, options, restore_signals=False, loop=args.loop)
    return EXIT_OK


def demo(args: argparse.Namespace) -> int:
    from sqlalchemy_pgtask.demo import run_demo

    return run_demo(timeout=args.timeout)
