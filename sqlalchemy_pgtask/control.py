"""control: exceptions a handler raises or meets to steer its task; they are not errors.

* `Fail` ends the task as failed at once, without using the remaining attempts.
* `Retry` asks for another attempt (it still counts as a failed attempt), optionally after a
  chosen delay instead of the policy's.
* `LeaseLost` and `TaskCancelled` tell a handler to stop: its lease is gone, or someone cancelled
  the task. They derive from `BaseException` so that a handler's ``except Exception:`` cannot
  swallow them and keep running work whose result would be discarded anyway.
* `Suspended` unwinds a handler whose task just went to sleep or started waiting (a durable
  sleep, a signal or child-result wait): the attempt is over, its lease already released, and
  the task runs again, replaying its checkpoints, when it wakes. Also a `BaseException`.
"""

from __future__ import annotations

from sqlalchemy_pgtask.validation import check_seconds

__all__ = ["Fail", "LeaseLost", "Retry", "Suspended", "TaskCancelled"]


class Fail(Exception):
    """Fail the task now, whatever attempts remain."""


class Retry(Exception):
    """Fail this attempt and retry; ``delay`` (seconds, at most 100 years) overrides the policy's.

    The attempt still counts against ``max_attempts``: when none remain, the task fails.
    """

    def __init__(self, message: str = "retry requested", *, delay: float | None = None) -> None:
        super().__init__(message)
        # Checked here, where the mistake is, rather than when the worker writes the outcome.
        self.delay = None if delay is None else check_seconds("delay", delay)


class LeaseLost(BaseException):
    """This attempt no longer owns the task; stop and let the current owner proceed.

    Raised by context calls of a synchronous handler after its lease expired, was taken over,
    or the worker released it at shutdown. Nothing this attempt writes afterwards is stored.
    """


class TaskCancelled(BaseException):
    """Someone cancelled the task; stop. The task ends as cancelled."""


class Suspended(BaseException):
    """The task is sleeping or waiting; this attempt is over and must unwind.

    Raised by a durable call that suspended the task. Let it propagate (``finally`` blocks
    run): a handler that catches it and goes on writes nothing, because its lease is gone.
    Suspensions never count against ``max_attempts``.
    """
