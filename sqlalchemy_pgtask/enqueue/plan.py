"""enqueue.plan: turns enqueue requests into statements, and their rows into results; no I/O.

Validation makes every request a `TaskRow` (JSON serialised once, id generated, every limit
checked) before any SQL runs. Planning picks the one statement for the batch. `execution` is
the whole conversation with the database as a generator of ``(statement, parameters)`` steps,
so the sync and async drivers in ``enqueue`` share it: one step in every common case, and a
few more only when an idempotency key was already reserved by a transaction the first
statement could not see, or its reservation expired and must be taken over.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple

from sqlalchemy import Executable

from sqlalchemy_pgtask import statements, telemetry
from sqlalchemy_pgtask._defaults import DEFAULT_QUEUE
from sqlalchemy_pgtask._ids import new_ids
from sqlalchemy_pgtask.errors import IdempotencyConflict, InvalidOptionError, ValidationError
from sqlalchemy_pgtask.validation import (
    INT2_MAX,
    INT2_MIN,
    INT4_MAX,
    PAYLOAD_MAX_BYTES,
    check_concurrency,
    check_delay,
    check_idempotency_key,
    check_int_range,
    check_queue_name,
    check_run_at,
    check_task_name,
    check_time_limit,
    dump_headers,
    dump_json,
)

__all__ = [
    "EnqueueRequest",
    "EnqueueResult",
    "Plan",
    "Step",
    "TaskRow",
    "execution",
    "new_ids",
    "plan_many",
    "plan_one",
    "validate_many",
    "validate_request",
]

#: How often a key left open by a concurrent transaction is looked at again before giving up.
_KEY_ROUNDS: Final = 3

#: One statement to run and its parameters; the driver sends back its rows (None if it
#: returns none).
Step = tuple[Executable, Mapping[str, Any]]


class EnqueueResult(NamedTuple):
    """What `enqueue` did: the task's id, and whether this call created it.

    ``created`` is False only for an idempotency key that was already reserved; ``id`` is then
    the id of the task that holds the reservation.
    """

    id: uuid.UUID
    created: bool


@dataclass(frozen=True, kw_only=True, init=False)
class EnqueueRequest:
    """One task for `enqueue_many`; the fields mean what `enqueue`'s arguments mean."""

    name: str
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    version: int = 1
    run_at: datetime | None = None
    delay: float | timedelta | None = None
    priority: int = 0
    #: None: the registered handler's ``max_attempts`` applies (filled in at first claim).
    max_attempts: int | None = None
    idempotency_key: str | None = None
    headers: Mapping[str, Any] | None = field(default=None, hash=False)
    #: None: the registered handler's ``timeout`` applies (if it has one).
    timeout: float | timedelta | None = None
    concurrency_key: str | None = None
    #: None: the registered handler's ``concurrency_limit`` applies (or 1).
    concurrency_limit: int | None = None

    def __init__(
        self, *, name: str, payload: Any = None, queue: str = DEFAULT_QUEUE, version: int = 1,
        run_at: datetime | None = None, delay: float | timedelta | None = None,
        priority: int = 0, max_attempts: int | None = None,
        idempotency_key: str | None = None, headers: Mapping[str, Any] | None = None,
        timeout: float | timedelta | None = None, concurrency_key: str | None = None,
        concurrency_limit: int | None = None,
    ) -> None:
        # A frozen dataclass's own __init__ sets each field by ``object.__setattr__``: half
        # the cost of a request, built a thousand times per bulk enqueue. One update of the
        # dict does the same (tests/unit/test_enqueue_request.py checks it against the fields).
        self.__dict__.update(
            name=name, payload=payload, queue=queue, version=version, run_at=run_at,
            delay=delay, priority=priority, max_attempts=max_attempts,
            idempotency_key=idempotency_key, headers=headers, timeout=timeout,
            concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
        )


class TaskRow(NamedTuple):
    """A validated request, ready to bind: JSON already serialised, ids already generated.

    A named tuple: built once per enqueued task, and cheaper to build than a frozen dataclass.
    """

    id: uuid.UUID
    queue: str
    name: str
    version: int
    payload: str
    headers: str
    priority: int
    max_attempts: int | None
    #: The fields above, in this order, are a ``COPY`` row (`sqlalchemy_pgtask.enqueue.copy`).
    timeout: float | None
    run_at: datetime | None
    delay: float
    key: str | None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None


def validate_request(request: EnqueueRequest, task_id: uuid.UUID, prefix: str = "") -> TaskRow:
    """Check every field of ``request`` and serialise its JSON; ``prefix`` names its place.

    With OpenTelemetry, the headers get the current trace context unless they carry one.
    """
    try:
        return _validated(request, task_id, telemetry.trace_carrier())
    except ValidationError as exc:
        if not prefix:
            raise
        raise _placed(exc, prefix) from exc.__cause__


def _placed(exc: ValidationError, prefix: str) -> ValidationError:
    # Field names are prefixed only on the way out: valid requests pay nothing for them.
    return type(exc)(f"{prefix}{exc.field}", exc.reason)


def _validated(
    request: EnqueueRequest, task_id: uuid.UUID, carrier: Mapping[str, str] | None
) -> TaskRow:
    # The order of the checks is part of the contract: a request with several bad fields names
    # the first of name, queue, version, priority, max_attempts, key, run_at/delay, payload,
    # headers, timeout, concurrency_key, concurrency_limit.
    name = check_task_name(request.name)
    queue = check_queue_name(request.queue)
    # The common case (a plain int in range) is checked inline: one bulk enqueue validates
    # every request, and the full check runs only for a value that may be wrong.
    version = request.version
    if type(version) is not int or not 1 <= version <= INT4_MAX:
        version = check_int_range("version", version, 1, INT4_MAX)
    priority = request.priority
    if type(priority) is not int or not INT2_MIN <= priority <= INT2_MAX:
        priority = check_int_range("priority", priority, INT2_MIN, INT2_MAX)
    max_attempts = request.max_attempts
    if max_attempts is not None:
        max_attempts = check_int_range("max_attempts", max_attempts, 1, INT4_MAX)
    key = request.idempotency_key
    if key is not None:
        key = check_idempotency_key(key)
    run_at, delay = request.run_at, request.delay
    if run_at is not None:
        if delay is not None:
            raise InvalidOptionError("run_at", "give either run_at or delay, not both")
        run_at = check_run_at("run_at", run_at)
    seconds = 0.0 if delay is None else check_delay("delay", delay)
    payload = dump_json("payload", request.payload, PAYLOAD_MAX_BYTES)
    headers = telemetry.with_trace_context(request.headers, carrier)
    headers_text = "{}" if headers is None else dump_headers(headers)
    timeout = None if request.timeout is None else check_time_limit("timeout", request.timeout)
    concurrency_key, limit = request.concurrency_key, request.concurrency_limit
    if concurrency_key is not None or limit is not None:
        concurrency_key, limit = check_concurrency(concurrency_key, limit)
    # Positional, in the fields' order: keywords double the cost of building the row.
    return TaskRow(
        task_id, queue, name, version, payload, headers_text, priority, max_attempts, timeout,
        run_at, seconds, key, concurrency_key, limit,
    )


class Plan(NamedTuple):
    """The one statement to run, its parameters, and how to turn its rows into results."""

    statement: Executable
    params: dict[str, Any]
    rows: list[TaskRow]
    #: For each request, the index of the request whose result it shares (itself, or the first
    #: request in the batch with the same queue and idempotency key).
    owners: list[int]
    returns_rows: bool

    @property
    def idempotent(self) -> bool:
        """Whether the statement reserves idempotency keys."""
        return self.statement is statements.ENQUEUE_BATCH_IDEMPOTENT


def _plan_row(row: TaskRow) -> Plan:
    # Every option at its default (explicit defaults such as delay=0 included): the short form.
    if (
        row.version == 1 and row.headers == "{}" and row.priority == 0 and not row.delay
        and row.max_attempts is None and row.timeout is None and row.run_at is None
        and row.key is None and row.concurrency_key is None
    ):
        params = {"id": row.id, "queue": row.queue, "name": row.name, "payload": row.payload}
        return Plan(statements.ENQUEUE_PLAIN, params, [row], [0], returns_rows=False)
    if row.key is None and row.concurrency_key is None:
        params = {
            "id": row.id, "queue": row.queue, "name": row.name, "version": row.version,
            "payload": row.payload, "headers": row.headers, "priority": row.priority,
            "max_attempts": row.max_attempts, "run_at": row.run_at, "delay": row.delay,
            "timeout_seconds": row.timeout,
        }
        return Plan(statements.ENQUEUE_ONE, params, [row], [0], returns_rows=False)
    return plan_many([row])


def plan_many(rows: list[TaskRow]) -> Plan:
    owners: list[int] = []
    first_of_key: dict[tuple[str, str], int] = {}
    unique: list[TaskRow] = []
    ords: list[int] = []
    for index, row in enumerate(rows):
        if row.key is not None:
            slot = first_of_key.setdefault((row.queue, row.key), index)
            if slot != index:
                # ON CONFLICT cannot touch one row twice in a statement: later duplicates of a
                # key in the same batch share the first one's result instead.
                owners.append(slot)
                continue
        owners.append(index)
        unique.append(row)
        ords.append(index)
    first = rows[0]
    shared = (first.queue, first.name, first.version, first.headers, first.priority,
              first.max_attempts, first.run_at, first.delay, first.timeout)
    if not first_of_key and first.concurrency_key is None and all(
        (row.queue, row.name, row.version, row.headers, row.priority, row.max_attempts,
         row.run_at, row.delay, row.timeout) == shared and row.concurrency_key is None
        for row in rows
    ):
        uniform = {
            "ids": [row.id for row in rows],
            "payloads": [row.payload for row in rows],
            "queue": first.queue, "name": first.name, "version": first.version,
            "headers": first.headers, "priority": first.priority,
            "max_attempts": first.max_attempts, "run_at": first.run_at, "delay": first.delay,
            "timeout_seconds": first.timeout,
        }
        return Plan(statements.ENQUEUE_UNIFORM, uniform, rows, owners, returns_rows=False)
    params = _batch_params(unique, ords)
    if first_of_key:
        return Plan(statements.ENQUEUE_BATCH_IDEMPOTENT, params, rows, owners, returns_rows=True)
    return Plan(statements.ENQUEUE_BATCH, params, rows, owners, returns_rows=False)


def _batch_params(rows: Sequence[TaskRow], ords: Sequence[int]) -> dict[str, Any]:
    return {
        "ords": list(ords),
        "ids": [row.id for row in rows],
        "queues": [row.queue for row in rows],
        "names": [row.name for row in rows],
        "versions": [row.version for row in rows],
        "payloads": [row.payload for row in rows],
        "headers": [row.headers for row in rows],
        "priorities": [row.priority for row in rows],
        "max_attempts": [row.max_attempts for row in rows],
        "run_ats": [row.run_at for row in rows],
        "delays": [row.delay for row in rows],
        "timeouts": [row.timeout for row in rows],
        "keys": [row.key for row in rows],
        "concurrency_keys": [row.concurrency_key for row in rows],
        "concurrency_limits": [row.concurrency_limit for row in rows],
    }


def execution(plan: Plan) -> Generator[Step, Sequence[Any] | None, list[EnqueueResult]]:
    """The statements that carry out ``plan``, one step at a time; returns the results.

    The first step is the plan's one statement. A reserved key whose answer that statement
    could not give (the reservation expired, or was committed after its snapshot) is settled
    by `TAKE_OVER_KEYS` with a fresh snapshot, which inserts its task if it took it over.
    """
    returned = yield plan.statement, plan.params
    if returned is None:
        by_index = {i: EnqueueResult(row.id, True) for i, row in enumerate(plan.rows)}
        return _per_request(plan, by_index)
    by_index = {int(r.ord): EnqueueResult(r.id, bool(r.created)) for r in returned if r.id}
    open_keys = sorted(int(r.ord) for r in returned if r.id is None)
    for _ in range(_KEY_ROUNDS):
        if not open_keys:
            break
        rows = [plan.rows[index] for index in open_keys]
        settled = yield statements.TAKE_OVER_KEYS, _batch_params(rows, open_keys)
        by_key = {(s.queue, s.key): s for s in settled or ()}
        vanished = []
        for index, row in zip(open_keys, rows, strict=True):
            reservation = by_key[(row.queue, row.key)]
            if reservation.task_id is None:  # deleted meanwhile: reserve it anew
                vanished.append(index)
            elif reservation.taken:  # its task was inserted by the same statement
                by_index[index] = EnqueueResult(row.id, True)
            else:
                by_index[index] = EnqueueResult(reservation.task_id, False)
        open_keys = []
        if vanished:
            again = yield statements.ENQUEUE_BATCH_IDEMPOTENT, _batch_params(
                [plan.rows[i] for i in vanished], vanished
            )
            for r in again or ():
                if r.id is None:
                    open_keys.append(int(r.ord))
                else:
                    by_index[int(r.ord)] = EnqueueResult(r.id, bool(r.created))
    if open_keys:
        raise IdempotencyConflict(
            f"{IdempotencyConflict()} Keys still contended after {_KEY_ROUNDS} rounds: "
            + ", ".join(repr(plan.rows[i].key) for i in open_keys)
        )
    return _per_request(plan, by_index)


def _per_request(plan: Plan, by_index: Mapping[int, EnqueueResult]) -> list[EnqueueResult]:
    results = []
    for index, owner in enumerate(plan.owners):
        result = by_index[owner]
        results.append(result if owner == index else EnqueueResult(result.id, False))
    return results


def plan_one(
    name: str,
    payload: Any,
    *,
    queue: str,
    version: int,
    run_at: datetime | None,
    delay: float | timedelta | None,
    priority: int,
    max_attempts: int | None,
    idempotency_key: str | None,
    headers: Mapping[str, Any] | None,
    timeout: float | timedelta | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> Plan:
    """Validate one enqueue's arguments and plan its statement."""
    request = EnqueueRequest(
        name=name, payload=payload, queue=queue, version=version, run_at=run_at, delay=delay,
        priority=priority, max_attempts=max_attempts, idempotency_key=idempotency_key,
        headers=headers, timeout=timeout, concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
    )
    return _plan_row(validate_request(request, new_ids(1)[0]))


def validate_many(requests: Iterable[EnqueueRequest]) -> list[TaskRow]:
    batch = list(requests)
    ids = new_ids(len(batch))
    carrier = telemetry.trace_carrier()  # the same for the whole batch
    rows = []
    for index, request in enumerate(batch):
        if not isinstance(request, EnqueueRequest):
            raise InvalidOptionError(
                f"[{index}]", f"must be an EnqueueRequest, got {type(request).__name__}"
            )
        try:
            rows.append(_validated(request, ids[index], carrier))
        except ValidationError as exc:
            raise _placed(exc, f"[{index}].") from exc.__cause__
    return rows
