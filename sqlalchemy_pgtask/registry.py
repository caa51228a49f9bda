"""registry: handlers by (queue, task name, handler version) with their policies; no I/O.

::

    registry = Registry()

    @registry.task("send-receipt", retry=RetryPolicy.exponential(base=2.0, max=300.0))
    async def send_receipt(ctx: TaskContext, payload: dict[str, int]) -> str:
        ...

    send_receipt.enqueue(session, {"order_id": 42})

A worker runs ``pgtask worker app.tasks:registry``; it claims only the (name, version) pairs
registered here, so a task for an unknown handler waits, untouched, for a worker that knows it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Generic, Protocol, TypeVar, overload

from sqlalchemy_pgtask._connection import AsyncBind, SyncBind
from sqlalchemy_pgtask.durable.context import SyncTaskContext, TaskContext
from sqlalchemy_pgtask.enqueue import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    EnqueueRequest,
    EnqueueResult,
    enqueue,
    enqueue_async,
)
from sqlalchemy_pgtask.errors import InvalidOptionError
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.schedule.spec import ScheduleSpec, schedule_spec
from sqlalchemy_pgtask.validation import (
    INT4_MAX,
    check_concurrency_scope,
    check_int_range,
    check_queue_name,
    check_task_name,
    check_time_limit,
)

__all__ = ["DEFAULT_RETRY", "DeclaredSchedule", "HandlerDecorator", "Registry", "TaskDefinition"]

PayloadT = TypeVar("PayloadT")
ResultT = TypeVar("ResultT")

#: Exponential backoff from 1 s doubling to 60 s, with full jitter.
DEFAULT_RETRY: Final = RetryPolicy.exponential(base=1.0, factor=2.0, max=60.0)

P = TypeVar("P")
R = TypeVar("R")


class HandlerDecorator(Protocol):
    """What `Registry.task` returns: registers an ``async def`` handler (which gets a
    `TaskContext`) or a plain ``def`` one (which gets a `SyncTaskContext`)."""

    @overload
    def __call__(
        self, handler: Callable[[TaskContext, P], Awaitable[R]]
    ) -> TaskDefinition[P, R]: ...

    @overload
    def __call__(self, handler: Callable[[SyncTaskContext, P], R]) -> TaskDefinition[P, R]: ...


@dataclass(frozen=True)
class TaskDefinition(Generic[PayloadT, ResultT]):
    """A registered handler and the defaults its tasks are enqueued with.

    Calling the definition calls the handler directly (useful in unit tests); `enqueue` adds a
    task for a worker to run.
    """

    name: str
    version: int
    queue: str
    retry: RetryPolicy
    max_attempts: int
    #: ``async def (TaskContext, payload)`` or ``def (SyncTaskContext, payload)``.
    handler: Callable[[Any, PayloadT], Any]
    #: Exception types that fail the task at once instead of retrying.
    non_retryable: tuple[type[BaseException], ...] = ()
    #: Seconds an attempt may run before it is stopped and fails with kind ``timeout``
    #: (retried by policy); None: no limit. A task enqueued with its own ``timeout`` uses that.
    timeout: float | None = None
    #: Tasks of one concurrency key that may hold it at once, unless a task was enqueued
    #: with its own limit; None: 1. Frozen with ``retry`` per (queue, name, version).
    concurrency_limit: int | None = None
    #: ``workflow``: a durable suspension (sleep, signal or child wait) keeps the key;
    #: ``running``: only a running attempt holds it. Frozen with ``retry``.
    concurrency_scope: str = "workflow"
    is_async: bool = field(init=False)

    def __post_init__(self) -> None:
        # Seconds as a float, whatever form it came in (an int, a timedelta): the worker binds
        # every handler's limit in one float array, where one int or timedelta fails the
        # claim of every handler.
        object.__setattr__(self, "timeout", check_time_limit("timeout", self.timeout))
        call = getattr(self.handler, "__call__", None)  # noqa: B004 - an async __call__ counts
        is_async = inspect.iscoroutinefunction(self.handler) or inspect.iscoroutinefunction(call)
        object.__setattr__(self, "is_async", is_async)

    def __call__(self, ctx: Any, payload: PayloadT) -> Any:
        return self.handler(ctx, payload)

    def request(
        self,
        payload: PayloadT,
        *,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, Any] | None = None,
        timeout: float | timedelta | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
    ) -> EnqueueRequest:
        """An `EnqueueRequest` for this handler, for `enqueue_many`."""
        return EnqueueRequest(
            name=self.name, payload=payload, queue=self.queue, version=self.version,
            run_at=run_at, delay=delay, priority=priority,
            max_attempts=self.max_attempts if max_attempts is None else max_attempts,
            idempotency_key=idempotency_key, headers=headers, timeout=timeout,
            concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
        )

    def enqueue(
        self,
        bind: SyncBind,
        payload: PayloadT,
        *,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, Any] | None = None,
        timeout: float | timedelta | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
    ) -> EnqueueResult:
        """Add a task for this handler in ``bind``'s transaction (see `enqueue`)."""
        return enqueue(
            bind, self.name, payload, queue=self.queue, version=self.version, run_at=run_at,
            delay=delay, priority=priority,
            max_attempts=self.max_attempts if max_attempts is None else max_attempts,
            idempotency_key=idempotency_key, headers=headers, timeout=timeout,
            concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
        )

    async def enqueue_async(
        self,
        bind: AsyncBind,
        payload: PayloadT,
        *,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, Any] | None = None,
        timeout: float | timedelta | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
    ) -> EnqueueResult:
        """`enqueue` for an `AsyncSession` or `AsyncConnection`."""
        return await enqueue_async(
            bind, self.name, payload, queue=self.queue, version=self.version, run_at=run_at,
            delay=delay, priority=priority,
            max_attempts=self.max_attempts if max_attempts is None else max_attempts,
            idempotency_key=idempotency_key, headers=headers, timeout=timeout,
            concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
        )


@dataclass(frozen=True)
class DeclaredSchedule:
    """A schedule declared in code: reconciled into ``pgtask.schedules`` at worker start."""

    definition: TaskDefinition[Any, Any]
    spec: ScheduleSpec

    @property
    def name(self) -> str:
        return self.spec.name


def _check_concurrency_policy(limit: object, scope: object) -> None:
    if limit is not None:
        check_int_range("concurrency_limit", limit, 1, INT4_MAX)
    check_concurrency_scope(scope)


DefinitionT = TypeVar("DefinitionT", bound=TaskDefinition[Any, Any])


class Registry:
    """The handlers one worker process can run."""

    def __init__(self) -> None:
        self._definitions: dict[tuple[str, str, int], TaskDefinition[Any, Any]] = {}
        self._schedules: dict[str, DeclaredSchedule] = {}

    def task(
        self,
        name: str,
        *,
        version: int = 1,
        queue: str = DEFAULT_QUEUE,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        non_retryable: tuple[type[BaseException], ...] = (),
        timeout: float | timedelta | None = None,
        concurrency_limit: int | None = None,
        concurrency_scope: str = "workflow",
    ) -> HandlerDecorator:
        """Register the decorated ``(ctx, payload)`` function, ``async def`` or plain ``def``.

        :param retry: when to retry a failed attempt; frozen per (queue, name, version) in the
            database by the first worker that registers it.
        :param max_attempts: failed attempts a task gets, unless it was enqueued with its own;
            frozen with ``retry`` per (queue, name, version).
        :param non_retryable: exception types that fail the task at once.
        :param timeout: time limit of each attempt (seconds or a timedelta), unless the task
            was enqueued with its own: past it, an ``async def`` handler is cancelled, a
            ``def`` handler's late result is discarded, and the attempt fails with kind
            ``timeout`` (retried by policy). Measured in database time from the claim.
        :param concurrency_limit: how many tasks of one ``concurrency_key`` may hold it at
            once (default 1), unless a task was enqueued with its own; frozen with ``retry``.
        :param concurrency_scope: ``"workflow"`` (a durable suspension keeps the key) or
            ``"running"`` (only a running attempt holds it); frozen with ``retry``.
        """

        time_limit = check_time_limit("timeout", timeout)
        _check_concurrency_policy(concurrency_limit, concurrency_scope)

        def register(handler: Callable[[Any, Any], Any]) -> TaskDefinition[Any, Any]:
            definition: TaskDefinition[Any, Any] = TaskDefinition(
                name=name, version=version, queue=queue, retry=retry,
                max_attempts=max_attempts, handler=handler, non_retryable=non_retryable,
                timeout=time_limit, concurrency_limit=concurrency_limit,
                concurrency_scope=concurrency_scope,
            )
            self.add(definition)
            return definition

        return register

    def add(self, definition: TaskDefinition[Any, Any]) -> None:
        """Register an existing definition (for example, one shared by two registries)."""
        check_task_name(definition.name)
        check_queue_name(definition.queue)
        check_int_range("version", definition.version, 1, INT4_MAX)
        check_int_range("max_attempts", definition.max_attempts, 1, INT4_MAX)
        check_time_limit("timeout", definition.timeout)
        _check_concurrency_policy(definition.concurrency_limit, definition.concurrency_scope)
        if not isinstance(definition.retry, RetryPolicy):
            raise InvalidOptionError("retry", "must be a RetryPolicy")
        if not callable(definition.handler):
            raise InvalidOptionError("handler", "must be callable")
        if not isinstance(definition.non_retryable, tuple):
            # A bare class is a common slip for (ValueError,); catch it here, not mid-task.
            raise InvalidOptionError(
                "non_retryable",
                f"must be a tuple of exception types, got {definition.non_retryable!r}"
                " (write non_retryable=(ValueError,) for one type)",
            )
        for exc_type in definition.non_retryable:
            if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
                raise InvalidOptionError("non_retryable", f"{exc_type!r} is not an exception type")
        key = (definition.queue, definition.name, definition.version)
        if key in self._definitions:
            raise InvalidOptionError(
                "name",
                f"{definition.name!r} version {definition.version} is already registered "
                f"on queue {definition.queue!r}",
            )
        self._definitions[key] = definition

    def schedule(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: float | timedelta | None = None,
        timezone: str = "UTC",
        payload: Any = None,
        headers: Mapping[str, Any] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        timeout: float | timedelta | None = None,
        misfire: str = "latest",
        catch_up_limit: int | None = None,
        overlap: str = "allow",
        start_at: datetime | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
    ) -> Callable[[DefinitionT], DefinitionT]:
        """Declare a recurring schedule of the decorated definition; stack it above
        ``@registry.task(...)``. The options mean what `set_schedule`'s mean.

        Workers reconcile declared schedules at start: a new or changed one is written (a
        changed one restarts from database now), an unchanged one keeps its cursor.
        """

        def declare(definition: DefinitionT) -> DefinitionT:
            self.add_schedule(
                name, definition, cron=cron, every=every, timezone=timezone, payload=payload,
                headers=headers, priority=priority, max_attempts=max_attempts,
                timeout=timeout, misfire=misfire, catch_up_limit=catch_up_limit,
                overlap=overlap, start_at=start_at, concurrency_key=concurrency_key,
                concurrency_limit=concurrency_limit,
            )
            return definition

        return declare

    def add_schedule(
        self, name: str, definition: TaskDefinition[Any, Any], **options: Any
    ) -> DeclaredSchedule:
        """Declare a schedule of a registered definition (see `schedule`)."""
        if not isinstance(definition, TaskDefinition):
            raise InvalidOptionError(
                "task", "@registry.schedule(...) goes above @registry.task(...)"
            )
        if self.get(definition.queue, definition.name, definition.version) is not definition:
            raise InvalidOptionError(
                "task", f"{definition.name!r} is not registered here; register it first"
            )
        spec = schedule_spec(
            name, task_name=definition.name, queue=definition.queue,
            version=definition.version, **options,
        )
        if spec.name in self._schedules:
            raise InvalidOptionError("name", f"schedule {name!r} is already declared")
        declared = DeclaredSchedule(definition=definition, spec=spec)
        self._schedules[spec.name] = declared
        return declared

    @property
    def schedules(self) -> list[DeclaredSchedule]:
        """The schedules declared in code, in declaration order."""
        return list(self._schedules.values())

    def get(self, queue: str, name: str, version: int) -> TaskDefinition[Any, Any] | None:
        """The definition for a task identity, or None."""
        return self._definitions.get((queue, name, version))

    @property
    def queues(self) -> list[str]:
        """Every queue with at least one handler, in registration order."""
        return list(dict.fromkeys(queue for queue, _, _ in self._definitions))

    def for_queue(self, queue: str) -> list[TaskDefinition[Any, Any]]:
        """The definitions registered on ``queue``."""
        return [d for (q, _, _), d in self._definitions.items() if q == queue]

    def __iter__(self) -> Iterator[TaskDefinition[Any, Any]]:
        return iter(self._definitions.values())

    def __len__(self) -> int:
        return len(self._definitions)
