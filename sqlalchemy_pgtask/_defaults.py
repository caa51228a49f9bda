"""_defaults: what a task gets when its caller says nothing, and what may name a task.

These sit below everything that adds or names tasks (enqueue, the registry, schedules, durable
spawns), so that none of those has to import another just for a default.
"""

from __future__ import annotations

from typing import Final, Protocol

__all__ = ["DEFAULT_MAX_ATTEMPTS", "DEFAULT_QUEUE", "SCHEDULE_HEADER", "TaskTarget"]

#: The queue of a task enqueued, spawned or scheduled without one.
DEFAULT_QUEUE: Final = "default"

#: The ``max_attempts`` of a handler registered without one.
DEFAULT_MAX_ATTEMPTS: Final = 5

#: The header a schedule's occurrence task carries: ``{"name": schedule, "scheduled_for":
#: ISO 8601 UTC}``. Written by the materialiser, refused in headers given by callers, and
#: taken out of the headers a handler sees (it reads ``ctx.schedule_name`` and
#: ``ctx.scheduled_for`` instead). A header, not a claimed column: the claim returns the
#: headers already, and stays under psycopg's limit for cached parsing.
SCHEDULE_HEADER: Final = "pgtask.schedule"


class TaskTarget(Protocol):
    """A registered ``TaskDefinition``, as the calls that take one instead of a bare task
    name see it: its name, queue and handler version, and its tasks' ``max_attempts``."""

    @property
    def name(self) -> str: ...

    @property
    def queue(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def max_attempts(self) -> int: ...
