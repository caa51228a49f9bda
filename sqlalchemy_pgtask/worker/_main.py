"""worker._main: `run`, a worker in the foreground of a process, stopped by SIGTERM or SIGINT.

The first signal drains (handlers get the grace period), the second hands running tasks back
at once, and any later one is ignored: the process is already on its way out, and a signal
must not kill it between the event loop closing and the interpreter exiting (which would turn
a clean exit into 143 or 130).

It runs the worker on uvloop when that is installed (the ``uvloop`` extra) unless told
otherwise: the worker's event loop is its bottleneck under load, and uvloop's is cheaper per
wake-up, socket wait and task switch.

While it runs, the cycle collector runs less often (`collector_for_throughput`): a worker
allocates a few dozen short-lived objects per task (rows, contexts, coroutines, futures),
almost none of them in reference cycles, so at Python's default threshold (a collection every
700 allocations) the collector ran every dozen tasks or so, and every tenth and hundredth
time walked the long-lived objects too (modules, SQLAlchemy's metadata and caches): a fifth
of the worker's CPU per task at concurrency 100.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import signal
import threading
from collections.abc import Coroutine, Iterator
from types import FrameType
from typing import Any, Final, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.registry import Registry
from sqlalchemy_pgtask.worker._options import EVENT_LOOPS, EventLoop, WorkerOptions
from sqlalchemy_pgtask.worker._runtime import Worker

__all__ = ["COLLECTOR_THRESHOLD", "collector_for_throughput", "resolve_event_loop", "run"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: The cycle collector's first threshold (allocations between collections of the youngest
#: generation) while `run` runs a worker, at the least.
COLLECTOR_THRESHOLD: Final = 50_000


def run(
    registry: Registry,
    database: str | AsyncEngine,
    options: WorkerOptions | None = None,
    *,
    handle_signals: bool = True,
    restore_signals: bool = True,
    loop: EventLoop = "auto",
) -> None:
    """Run a `Worker` until SIGTERM or SIGINT (or `Worker.shutdown`), then return.

    With ``handle_signals`` (main thread only) the first signal drains, the second stops at
    once. ``restore_signals=False`` ignores the two signals once the worker stopped, for a
    process that exits right after (the ``pgtask worker`` command): a late signal must not
    turn its clean exit into a death by signal. ``loop`` picks the event loop (see
    `resolve_event_loop`).

    :raises InvalidOptionError: ``loop`` is unknown, or ``"uvloop"`` is not installed.
    :raises WorkerCrashed: an internal loop failed (the process should exit non-zero).
    """
    chosen = resolve_event_loop(loop)
    worker = Worker(registry, database, options)
    if not handle_signals or threading.current_thread() is not threading.main_thread():
        _run_on(chosen, worker.run())
        return
    received = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        name = signal.Signals(signum).name
        if received == 1:
            logger.info("%s: draining (send it again to stop at once)", name)
            worker.shutdown()
        elif received == 2:
            logger.warning("%s again: handing running tasks back and stopping now", name)
            worker.shutdown(immediate=True)
        else:
            logger.info("%s ignored: already stopping", name)

    previous: dict[signal.Signals, Any] = {s: signal.signal(s, on_signal) for s in _SIGNALS}
    try:
        _run_on(chosen, worker.run())
    finally:
        for signum, handler in previous.items():
            # SIG_IGN, not a Python handler: the interpreter resets Python handlers to the
            # default (death by that signal) while it exits, but leaves ignored signals alone.
            signal.signal(signum, handler if restore_signals else signal.SIG_IGN)


def resolve_event_loop(loop: str) -> Literal["asyncio", "uvloop"]:
    """The loop ``loop`` names: ``"auto"`` is uvloop where it can be imported, else asyncio.

    :raises InvalidOptionError: an unknown name, or ``"uvloop"`` without uvloop installed.
    """
    if loop not in EVENT_LOOPS:
        raise InvalidOptionError(
            "loop", f"must be one of {', '.join(EVENT_LOOPS)}, got {loop!r}"
        )
    if loop == "asyncio":
        return "asyncio"
    try:
        importlib.import_module("uvloop")
    except ImportError:
        if loop == "uvloop":
            raise InvalidOptionError(
                "loop", "uvloop is not installed (pip install 'sqlalchemy-pgtask[uvloop]')"
            ) from None
        return "asyncio"
    return "uvloop"


@contextlib.contextmanager
def collector_for_throughput() -> Iterator[None]:
    """Within the block the collector's first threshold is at least `COLLECTOR_THRESHOLD`,
    and the objects that exist on entry are frozen out of its collections (`gc.freeze`,
    unless the process froze some itself: that is its business); both are undone on exit.
    Garbage in cycles still goes, after more allocations; what reference counting frees
    (nearly everything a task allocates) goes at once, as ever.
    """
    first, second, third = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(first, COLLECTOR_THRESHOLD), second, third)
    try:
        yield
    finally:
        gc.set_threshold(first, second, third)
        if freeze:
            gc.unfreeze()


def _run_on(loop: Literal["asyncio", "uvloop"], main: Coroutine[Any, Any, None]) -> None:
    with collector_for_throughput():
        if loop == "uvloop":
            importlib.import_module("uvloop").run(main)
        else:
            asyncio.run(main)
