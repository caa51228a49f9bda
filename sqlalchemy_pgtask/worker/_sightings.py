"""worker._sightings: which peers instant rescue counts as gone, from what one rescuer saw of
their advisory locks pass after pass (`statements.rescue.WORKER_LOCKS`); no I/O.

A peer is gone when this rescuer knew it alive during the life of its own backend (seen
holding its lock, or registered since), then found the lock missing on two passes in a row,
and the server ended no session of the database meanwhile. A server restart or a failover
ends the rescuer's backend too, and it starts afresh; a brief network cut gives the worker a
pass to take its lock again. Sessions the server ended itself (``pg_terminate_backend``, a
fatal error) may have been a live worker's, refused new connections for as long as the
server likes (``max_connections`` reached, the database closed to connections): those peers
are left to their leases, which the worker renews again once it is back, or which expire.
Only the end of file on a client's socket, a process that went away, rescues at once.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

__all__ = ["Sightings"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")


class Sightings:
    """One rescuer's memory of its peers' locks, and its verdict after each look.

    "Registered since" means a row this backend's previous look did not read, not a
    ``started_at`` compared with the database clock, which can be moved. A peer rescued (or
    left to its lease) is forgotten until it is seen holding its lock again, so the rescuer
    does not look for it at twice its rate until its row is pruned.
    """

    def __init__(self) -> None:
        #: The backend (pid, start) the observations below were made on.
        self._backend: tuple[int, object] | None = None
        #: The workers (with a lock) the last look on that backend read: a row a look reads
        #: that the one before did not was registered since.
        self._known: set[uuid.UUID] = set()
        #: Workers seen holding their lock on that backend.
        self._seen: set[uuid.UUID] = set()
        #: Workers seen holding it earlier, then missing it on the last look, each with the
        #: count of sessions the server had ended by the last look that knew it alive.
        self._missing: dict[uuid.UUID, int | None] = {}
        #: That count at the last look (None where PostgreSQL does not count them).
        self._ended: int | None = None

    @property
    def missing(self) -> bool:
        """Some lock was found missing on the last look: look again soon."""
        return bool(self._missing)

    def gone(self, state: Any) -> set[uuid.UUID]:
        """The workers to rescue now, given a look (a row of `WORKER_LOCKS`)."""
        backend = (state.backend, state.backend_start)
        holding, gone = set(state.holding or ()), set(state.gone or ())
        if backend != self._backend:
            self._backend, self._known = backend, holding | gone
            self._seen, self._missing, self._ended = set(), {}, state.ended
        # Registered since the last look (its row was committed after that look's snapshot):
        # it took its lock before it registered, so it held it during our session.
        self._seen |= gone - self._known
        self._known = holding | gone
        doomed = gone & self._missing.keys()
        spared = {w for w in doomed if self._missing[w] != state.ended}
        self._missing = {w: self._missing.get(w, self._ended) for w in gone & self._seen}
        self._seen = (self._seen & gone) | holding
        self._ended = state.ended
        for worker in sorted(spared):
            logger.warning(
                "worker %s lost its lock while the server ended sessions of this database:"
                " its tasks are left to their leases", worker,
            )
        self.forget(spared)
        return doomed - spared

    def forget(self, workers: set[uuid.UUID]) -> None:
        """Look for ``workers`` no more until they are seen holding their lock again."""
        self._seen -= workers
        for worker in workers:
            self._missing.pop(worker, None)
