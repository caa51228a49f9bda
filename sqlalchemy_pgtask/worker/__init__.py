"""worker: the asyncio runtime that claims tasks, runs handlers and records their outcomes.

Public: `Worker` (run it inside your own event loop), `WorkerOptions`, and `run` (a worker in
the foreground of a process, with signal handling, on uvloop when installed, with the cycle
collector's first threshold at least `COLLECTOR_THRESHOLD`; what ``pgtask worker`` calls).

The private modules, one responsibility each (after River's ``internal/<responsibility>``):
``_producer`` (claims), ``_executor`` (handlers and their threads), ``_completer`` (outcome
writes), ``_leases`` (renewal and the watchdog), ``_listener`` (LISTEN), ``_registration``
(worker row, capabilities, policies, heartbeat), ``_maintenance`` (recovery, pruning, and later
schedules and retention behind one protocol), ``_reconnect`` (backoff and held connections),
``_attempts`` (the state they share), ``_runtime`` (the `Worker` that supervises them).

Deadlines are always computed by PostgreSQL; this process's clock only measures its own
intervals (monotonic), never a stored timestamp.
"""

from __future__ import annotations

from sqlalchemy_pgtask.worker._main import COLLECTOR_THRESHOLD, run
from sqlalchemy_pgtask.worker._options import EventLoop, WorkerOptions
from sqlalchemy_pgtask.worker._reconnect import NETWORK_DEFAULTS
from sqlalchemy_pgtask.worker._runtime import Worker

__all__ = ["COLLECTOR_THRESHOLD", "NETWORK_DEFAULTS", "EventLoop", "Worker", "WorkerOptions", "run"]
