"""errors: every exception sqlalchemy-pgtask raises; never raised for handler control flow.

The tree::

    PgTaskError
     ├── ValidationError (also a ValueError)    bad input, raised before any SQL runs
     │    ├── InvalidNameError                  queue, task or key name breaks the naming rule
     │    ├── PayloadError                      not JSON, too large, or contains NUL characters
     │    └── InvalidOptionError                an option out of range or contradicting another
     │         └── DuplicateStep                a durable handler used one step key twice in a run
     ├── QueueFull                              SQLSTATE PT001: the queue is at capacity
     ├── IdempotencyConflict                    SQLSTATE 40001: the key was taken by a
     │                                          transaction this one's snapshot cannot see
     ├── TaskNotVisible                         SQLSTATE 40001: the task was committed after
     │                                          this transaction's snapshot
     ├── SchemaNotInstalled                     the pgtask schema is missing or out of date
     ├── TaskNotFound                           no task with that id
     ├── TaskNotRetryable                       an administrative retry of a task that is
     │                                          not failed or cancelled
     ├── ReplayMismatch                         a durable call does not match what an
     │                                          earlier attempt recorded under its step key
     │                                          (this one and DuplicateStep fail the task
     │                                          at once: a retry would meet them again)
     ├── WorkerCrashed                          an internal loop of a worker failed; the
     │                                          worker stopped and handed its tasks back
     ├── PolicyConflict                         a handler's retry policy or max_attempts
     │                                          differs from the one frozen for its identity
     └── ServerNotFound                         no PostgreSQL could be found or started
                                                (tests and the demo only)

Database errors are wrapped once, at the boundary where they are understood, with
``raise ... from exc`` so the original driver error stays attached. Passing the wrong kind of
bind (an ``Engine``, or an ``AsyncSession`` to a synchronous function) is a programming error,
not bad data: it raises the built-in ``TypeError``, before any SQL runs.
"""

from __future__ import annotations

__all__ = [
    "DuplicateStep",
    "IdempotencyConflict",
    "InvalidNameError",
    "InvalidOptionError",
    "PayloadError",
    "PgTaskError",
    "PolicyConflict",
    "QueueFull",
    "ReplayMismatch",
    "SchemaNotInstalled",
    "ServerNotFound",
    "TaskNotFound",
    "TaskNotRetryable",
    "TaskNotVisible",
    "ValidationError",
    "WorkerCrashed",
]


class PgTaskError(Exception):
    """Base class of every sqlalchemy-pgtask error.

    When raised without arguments, the docstring's first line is the message.
    """

    def __init__(self, *args: object) -> None:
        if not args and self.__doc__:
            args = (self.__doc__.strip().splitlines()[0],)
        super().__init__(*args)


class ValidationError(PgTaskError, ValueError):
    """Invalid input; nothing was written.

    ``field`` names the argument that was rejected (for ``enqueue_many``, prefixed with the
    request's index, as in ``"[3].payload"``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class InvalidNameError(ValidationError):
    """A queue, task or idempotency-key name breaks the naming rule."""


class PayloadError(ValidationError):
    """A JSON value (payload, headers, result) is not serialisable, too large, or holds NUL."""


class InvalidOptionError(ValidationError):
    """An option is out of range or contradicts another option."""


class DuplicateStep(InvalidOptionError):
    """A durable handler used the same step name and occurrence twice in one run.

    Every run of the handler makes the same calls, so a retry would fail the same way: the
    worker fails the task at once (error kind ``duplicate_step``).
    """


class QueueFull(PgTaskError):
    """The queue has reached its capacity of outstanding tasks (SQLSTATE PT001).

    Capacity is back-pressure, not loss: nothing was written, and the producer may retry later.
    """

    sqlstate = "PT001"


class IdempotencyConflict(PgTaskError):
    """The idempotency key was taken after this transaction's snapshot; retry the transaction.

    Under REPEATABLE READ or SERIALIZABLE, PostgreSQL cannot return a reservation committed by
    a concurrent transaction after this one's snapshot (SQLSTATE 40001). The transaction is
    aborted and nothing was written: roll back and retry the whole transaction, whose new
    snapshot sees the reservation, so the retry returns the existing task with
    ``created=False``.
    """

    sqlstate = "40001"


class TaskNotVisible(PgTaskError):
    """The task was committed after this transaction's snapshot; retry the transaction.

    Under REPEATABLE READ or SERIALIZABLE a transaction sees only what was committed before
    its first statement: a signal to a task created since cannot be stored in it (SQLSTATE
    40001, a serialization failure). Nothing was written: roll back and retry the whole
    transaction, whose new snapshot sees the task. A task that does not exist at all raises
    `TaskNotFound` instead.
    """

    sqlstate = "40001"


class SchemaNotInstalled(PgTaskError):
    """The pgtask schema is not installed: run `pgtask migrate` or `alembic upgrade heads`."""


class TaskNotFound(PgTaskError):
    """No task exists with that id."""


class TaskNotRetryable(PgTaskError):
    """Only a failed or cancelled task can be retried; this one is in another state.

    Nothing was written. ``task_id`` and ``state`` (the task's state when the retry looked)
    say which task and why.
    """

    def __init__(self, task_id: object, state: str) -> None:
        super().__init__(
            f"task {task_id} is {state}; only failed or cancelled tasks can be retried"
        )
        self.task_id = task_id
        self.state = state


class PolicyConflict(PgTaskError):
    """A handler's retry policy or max_attempts differs from the one frozen for its identity.

    Policies are immutable per (queue, task name, handler version) so tasks already in flight
    keep retrying as they were promised. Register the new policy under a new handler version.
    """


class ReplayMismatch(PgTaskError):
    """A durable call does not match the checkpoint an earlier attempt stored under its key.

    For example ``ctx.step("charge", ...)`` where an earlier attempt slept under the step name
    ``"charge"``: the handler's durable calls changed incompatibly. Register the changed
    handler under a new version, and keep the old one registered until its tasks finish.
    Every retry would meet the same checkpoint: the worker fails the task at once (error kind
    ``replay_mismatch``).
    """


class WorkerCrashed(PgTaskError):
    """An internal loop of the worker failed; the worker stopped and handed its tasks back.

    The cause (``__cause__``) is the loop's exception: something no retry can fix, such as a
    permission the worker's role lacks or a schema that was changed under it. ``loop`` names
    the loop that failed (``"producer"``, ``"completer"``, ...), or is None.
    """

    def __init__(self, *args: object, loop: str | None = None) -> None:
        super().__init__(*args)
        self.loop = loop


class ServerNotFound(PgTaskError):
    """No PostgreSQL server could be found or started."""
