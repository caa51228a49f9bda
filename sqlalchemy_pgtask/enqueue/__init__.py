"""enqueue: adds tasks inside the caller's transaction; never commits, never opens a connection.

`api` holds the calls; `plan` checks every request and builds the rows before anything is
written; `copy` writes large batches with ``COPY``. See ``docs/enqueue.md``.
"""

from __future__ import annotations

from sqlalchemy_pgtask.enqueue.api import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    EnqueueRequest,
    EnqueueResult,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_QUEUE",
    "EnqueueRequest",
    "EnqueueResult",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]
