"""worker._services: the maintenance services every worker runs, built from its options."""

from __future__ import annotations

from sqlalchemy_pgtask.worker._maintenance import (
    MaintenanceService,
    Recovery,
    Rescue,
    WaitTimeouts,
    WorkerPruning,
)
from sqlalchemy_pgtask.worker._options import WorkerOptions
from sqlalchemy_pgtask.worker._retention import Retention
from sqlalchemy_pgtask.worker._schedule import Schedules

__all__ = ["maintenance_services"]


def maintenance_services(options: WorkerOptions) -> list[MaintenanceService]:
    """Rescue, recovery, wait timeouts, schedules, retention and worker pruning, in that
    order of precedence when several are due at once."""
    rescue: list[MaintenanceService] = []
    if options.instant_rescue:
        rescue.append(
            Rescue(interval=options.rescue_interval, batch_size=options.recovery_batch_size)
        )
    return [
        *rescue,
        Recovery(
            interval=options.lease_duration / 3, batch_size=options.recovery_batch_size
        ),
        WaitTimeouts(
            interval=min(options.poll_interval, 5.0),
            batch_size=options.wait_timeout_batch_size,
        ),
        Schedules(interval=options.schedule_interval, batch_size=options.schedule_batch_size),
        Retention(interval=options.retention_interval, batch_size=options.retention_batch_size),
        WorkerPruning(
            interval=max(options.worker_ttl, 60.0), retention=options.worker_retention
        ),
    ]
