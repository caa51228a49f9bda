"""worker._stuck: a ``def`` handler still running when its lease can expire.

Python cannot interrupt a thread, so a synchronous handler told to stop (its lease could not be
renewed, the worker stops, its time limit ran out) may go on running in user code. Once its
lease can expire another worker may start the task again, and the two runs overlap. The
operator chooses what then happens (``WorkerOptions.on_stuck_handler``, ``--on-stuck-handler``):

* ``warn`` (the default): log it, once per attempt, and keep serving; the second run may
  overlap the first (its database writes are fenced by the lease, its other effects are not);
* ``exit``: end the worker process at once with `STUCK_HANDLER_EXIT_CODE`, so that no second
  run overlaps this one; its connections close with it, so peers rescue its tasks at once
  (instant rescue) or at lease expiry, and a supervisor restarts the process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from sqlalchemy_pgtask.worker._attempts import ActiveAttempt

__all__ = ["ON_STUCK_HANDLER", "STUCK_HANDLER_EXIT_CODE", "OnStuckHandler", "StuckHandlers"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

OnStuckHandler = Literal["warn", "exit"]
ON_STUCK_HANDLER: Final[tuple[str, ...]] = ("warn", "exit")

#: The exit status of a worker that ended itself for a stuck handler (``EX_TEMPFAIL``: a
#: supervisor should start it again).
STUCK_HANDLER_EXIT_CODE: Final = 75

#: The part of a lease after its last extension at which a handler still running after its
#: stop request is stuck: before the lease can expire, so ``exit`` ends it in time.
STUCK_FRACTION: Final = 0.9


class StuckHandlers:
    def __init__(self, policy: OnStuckHandler) -> None:
        self.policy = policy
        self._reported: weakref.WeakSet[ActiveAttempt] = weakref.WeakSet()

    def report(self, attempt: ActiveAttempt, done: threading.Event | None = None) -> None:
        """``attempt``'s synchronous handler still runs after its stop request, and its lease
        can expire: warn, or end the process (the policy). Nothing if ``done`` is set."""
        if (done is not None and done.is_set()) or attempt in self._reported:
            return
        self._reported.add(attempt)
        ctx = attempt.ctx
        what = (
            f"task {ctx.task_id} attempt {ctx.attempt}: its synchronous handler still runs "
            f"after its stop request ({ctx.stop_reason}) and its lease can expire"
        )
        if self.policy == "exit":
            logger.critical(
                "%s; exiting with status %d so that no second run overlaps it "
                "(--on-stuck-handler exit)", what, STUCK_HANDLER_EXIT_CODE,
            )
            for handler in logging.getLogger().handlers + logger.handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(STUCK_HANDLER_EXIT_CODE)  # a thread cannot be stopped; the process can
        logger.warning(
            "%s; a second run may overlap it (--on-stuck-handler warn)", what,
        )
