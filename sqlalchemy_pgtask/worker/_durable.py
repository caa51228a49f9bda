"""worker._durable: runs handlers' durable calls (steps, sleeps, waits, spawns) for the worker.

`DurableAttempt` is one attempt's side of the durable calls (the `DurableRuntime` its context
talks to): the checkpoints an earlier attempt stored (read once, on the first durable call of a
replay), the step keys this run used, and the suspension. The statements run through the
worker-wide `DurableCalls`.

A durable write whose outcome is unknown (the connection broke around its commit) is simply
sent again: each is idempotent per step key and fenced by the lease. A suspending call that
finds its lease gone after such a retry concludes that its first try committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import Coroutine, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from sqlalchemy_pgtask._connection import parse_task_id, translated_errors
from sqlalchemy_pgtask._defaults import TaskTarget
from sqlalchemy_pgtask.control import LeaseLost, Suspended, TaskCancelled
from sqlalchemy_pgtask.durable.types import ChildResult, StepKey
from sqlalchemy_pgtask.enqueue.plan import EnqueueRequest, new_ids, validate_request
from sqlalchemy_pgtask.errors import DuplicateStep, InvalidOptionError, ReplayMismatch
from sqlalchemy_pgtask.statements import (
    CHECKPOINT,
    CHECKPOINTS,
    FENCE_STATE,
    LOCK_CHILD,
    LOCK_FOR_WAIT,
    REGISTER_RESULT_WAIT,
    REGISTER_SIGNAL_WAIT,
    SAVE_CHECKPOINT,
    SLEEP,
    SPAWN,
    DurableParams,
    durable_params,
)
from sqlalchemy_pgtask.states import RUNNING
from sqlalchemy_pgtask.validation import (
    CHECKPOINT_MAX_BYTES,
    INT4_MAX,
    check_delay,
    check_int_range,
    check_run_at,
    check_step_name,
    check_task_name,
    dump_json,
)
from sqlalchemy_pgtask.worker._attempts import ActiveAttempt
from sqlalchemy_pgtask.worker._durable_calls import DurableCalls
from sqlalchemy_pgtask.worker._transactions import AsyncTransactionStep, SyncTransactionStep

if TYPE_CHECKING:
    from sqlalchemy_pgtask.durable.context import BaseTaskContext

__all__ = ["DurableAttempt"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

T = TypeVar("T")

#: Options `spawn` passes on to the child, as `enqueue` names them.
_SPAWN_OPTIONS = frozenset({
    "queue", "version", "run_at", "delay", "priority", "max_attempts", "headers", "timeout",
    "concurrency_key", "concurrency_limit",
})


class DurableAttempt:
    """One attempt's durable calls: the `DurableRuntime` its context uses."""

    def __init__(
        self, calls: DurableCalls, active: ActiveAttempt, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.calls = calls
        self.active = active
        self.ctx: BaseTaskContext = active.ctx
        self.lease = active.lease
        self.loop = loop
        #: Checkpoints by key; None until read (a first attempt has none to read).
        self._stored: dict[StepKey, tuple[str, Any]] | None = (
            {} if self.lease.attempt == 1 else None
        )
        self._used: set[StepKey] = set()
        #: Stored sleeps whose wake time was still ahead when the checkpoints were read.
        self._asleep: set[StepKey] = set()
        #: A call of this attempt was sent again after a transient failure.
        self.retried = False

    # -- keys and replay -------------------------------------------------------------------

    def key(self, step: object, occurrence: object) -> StepKey:
        """The checkpoint key of a call about to be made; reserves nothing.

        A key is used up by the call's replay lookup (`_lookup`), which every durable call
        makes once its own arguments are valid: a call refused for a bad argument leaves its
        key free, and raises the same error on a replay. Anything a call finds wrong after
        the lookup (a full queue, a stranger's task id, a result that is not JSON) happens
        with the key used, since a replay's lookup could return a checkpoint there instead.
        """
        name = check_step_name(step)
        number = check_int_range("occurrence", occurrence, 0, INT4_MAX)
        key = (name, number)
        self._check_unused(key)
        return key

    def _check_unused(self, key: StepKey) -> None:
        if key in self._used:
            raise DuplicateStep(
                "step",
                f"{key[0]!r} (occurrence {key[1]}) was already used in this run; give each "
                "durable call its own step name, or count occurrences from durable data",
            )

    def params(self, key: StepKey) -> DurableParams:
        return durable_params(self.lease, self.ctx.version, key[0], key[1])

    def _lookup(self, key: StepKey, kind: str) -> tuple[bool, Any]:
        """Use up ``key``; return its checkpoint of ``kind``, if an earlier attempt stored one."""
        assert self._stored is not None
        self._check_unused(key)
        self._used.add(key)
        entry = self._stored.get(key)
        if entry is None:
            return False, None
        stored_kind, value = entry
        if stored_kind != kind:
            raise ReplayMismatch(
                f"step {key[0]!r} (occurrence {key[1]}) of {self.ctx.name} v{self.ctx.version}:"
                f" an earlier attempt recorded a {stored_kind} there, this run makes a {kind}"
                " call. Changed durable calls need a new handler version."
            )
        return True, value

    def replayed_now(self, key: StepKey, kind: str) -> tuple[bool, Any] | None:
        self.guard()
        return None if self._stored is None else self._lookup(key, kind)

    async def replayed(self, key: StepKey, kind: str) -> tuple[bool, Any]:
        self.guard()
        if self._stored is None:
            rows = await self.calls.rows(
                self, CHECKPOINTS,
                {"task": self.lease.task_id, "handler_version": self.ctx.version},
            )
            self._stored = {(r.step, r.occurrence): (r.kind, r.value) for r in rows}
            self._asleep = {(r.step, r.occurrence) for r in rows if r.asleep}
        return self._lookup(key, kind)

    def remember(self, key: StepKey, kind: str, value: Any) -> None:
        if self._stored is not None:
            self._stored[key] = (kind, value)

    # -- the attempt's end -----------------------------------------------------------------

    def guard(self) -> None:
        """Refuse durable calls once the attempt suspended, lost its lease or was cancelled."""
        if self.active.suspended:
            raise Suspended(f"task {self.lease.task_id} is suspended; this attempt is over")
        if self.ctx.stop_reason == "cancelled":
            raise TaskCancelled(f"task {self.lease.task_id} was cancelled")
        if self.ctx.stop_reason == "lease_lost":
            raise LeaseLost(f"attempt {self.lease.attempt} of {self.lease.task_id} lost its lease")

    def suspend(self, why: str) -> NoReturn:
        self.active.suspended = True
        self.calls.book.stop_renewing(self.active)
        logger.info(
            "task %s %s attempt %d suspended: %s", self.lease.task_id, self.ctx.name,
            self.lease.attempt, why,
        )
        raise Suspended(f"task {self.lease.task_id} {why}")

    async def fence_failed(
        self, *, suspending: bool, unless_ours: BaseException | None = None
    ) -> NoReturn:
        """A fenced write matched nothing: say why, by raising what ends the handler.

        ``unless_ours``: the write failed with this error instead, which is raised again if
        the lease turns out to be this attempt's after all (a failure it did not cause).
        """
        rows = await self.calls.rows(self, FENCE_STATE, {"task": self.lease.task_id})
        row = rows[0] if rows else None
        ours = (
            row is not None and row.state == RUNNING and row.attempt == self.lease.attempt
            and row.lease_token == self.lease.token
        )
        if ours and row is not None and row.cancel:
            self.ctx.request_stop("cancelled")
            raise TaskCancelled(f"task {self.lease.task_id} was cancelled")
        if ours and unless_ours is not None:
            raise unless_ours
        if not ours and suspending and self.retried:
            self.suspend("(its suspension committed before the connection broke)")
        self.ctx.request_stop("lease_lost")
        raise LeaseLost(f"attempt {self.lease.attempt} of {self.lease.task_id} lost its lease")

    # -- durable calls ---------------------------------------------------------------------

    async def save(self, key: StepKey, kind: str, value: Any) -> Any:
        document = dump_json(f"step {key[0]!r}", value, CHECKPOINT_MAX_BYTES)
        self.guard()
        params = {**self.params(key), "kind": kind, "value": document}
        row = (await self.calls.rows(self, SAVE_CHECKPOINT, params))[0]
        if not row.held:
            await self.fence_failed(suspending=False)
        if row.saved:  # as jsonb keeps it, so the first run sees what its replays will
            stored = row.stored
        else:  # the first committed value wins (an earlier try of this very call)
            found = (await self.calls.rows(self, CHECKPOINT, self.params(key)))[0]
            if found.kind != kind:
                raise ReplayMismatch(f"step {key[0]!r}: stored as a {found.kind}, not a {kind}")
            stored = found.value
        self.remember(key, kind, stored)
        return stored

    async def sleep(
        self, key: StepKey, *, delay: float | timedelta | None, wake_at: datetime | None
    ) -> None:
        seconds = None if delay is None else check_delay("seconds", delay)
        when = None if wake_at is None else check_run_at("when", wake_at)
        found, _ = await self.replayed(key, "sleep")
        if found and key not in self._asleep:
            return
        # A first sleep, or a replayed one whose wake time has not come (a retry, a task woken
        # early): the statement keeps the wake time stored first and sleeps until it.
        self.retried = False
        params = {**self.params(key), "delay": seconds, "wake_at": when}
        row = (await self.calls.rows(self, SLEEP, params))[0]
        if not row.held:
            await self.fence_failed(suspending=True)
        self.remember(key, "sleep", {"wake_at": row.wake_at.isoformat()})
        if row.suspended:
            self.suspend(f"sleeps until {row.wake_at.isoformat()} (step {key[0]!r})")

    async def wait_for_signal(
        self, key: StepKey, signal: object, signal_occurrence: object, timeout: object
    ) -> Any:
        name = check_task_name(signal, "signal")
        number = check_int_range("signal_occurrence", signal_occurrence, 0, INT4_MAX)
        seconds = None if timeout is None else check_delay("timeout", timeout)
        found, value = await self.replayed(key, "signal")
        if found:
            return _signal_value(value)
        self.retried = False
        params = {
            **self.params(key), "signal": name, "signal_occurrence": number, "timeout": seconds,
        }

        async def register(connection: AsyncConnection) -> Row[Any] | None:
            locked = (await connection.execute(LOCK_FOR_WAIT, params)).first()
            if locked is None or locked.cancel:
                return None
            row: Row[Any] = (await connection.execute(REGISTER_SIGNAL_WAIT, params)).one()
            return row

        row = await self.calls.run(self, register, transaction=True)
        if row is None or not row.held:
            await self.fence_failed(suspending=True)
        if row.waiting:
            if seconds is not None:
                self.calls.on_wait(seconds)
            self.suspend(f"waits for signal {name!r} #{number} (step {key[0]!r})")
        self.remember(key, "signal", row.value)
        return _signal_value(row.value)

    async def spawn(
        self,
        key: StepKey,
        name: str | TaskTarget,
        payload: Any,
        options: Mapping[str, Any],
    ) -> uuid.UUID:
        unknown = sorted(set(options) - _SPAWN_OPTIONS)
        if unknown:
            raise InvalidOptionError(
                unknown[0],
                "is not an option of spawn (its step key already makes the child exactly-once)"
                if unknown[0] == "idempotency_key" else "is not an option of spawn",
            )
        if isinstance(name, str):
            defaults: dict[str, Any] = {"queue": self.ctx.queue}
            task_name = name
        else:
            defaults = {
                "queue": name.queue, "version": name.version, "max_attempts": name.max_attempts,
            }
            task_name = name.name
        child_id = new_ids(1)[0]
        row = validate_request(
            EnqueueRequest(name=task_name, payload=payload, **{**defaults, **options}), child_id
        )
        found, value = await self.replayed(key, "spawn")
        if found:
            return uuid.UUID(value["task_id"])
        params = {
            **self.params(key), "child_id": row.id, "child_queue": row.queue,
            "child_name": row.name, "child_version": row.version,
            "child_payload": row.payload, "child_headers": row.headers,
            "child_priority": row.priority, "child_max_attempts": row.max_attempts,
            "child_run_at": row.run_at, "child_delay": row.delay, "child_timeout": row.timeout,
            "child_concurrency_key": row.concurrency_key,
            "child_concurrency_limit": row.concurrency_limit,
        }
        with translated_errors():
            spawned = (await self.calls.rows(self, SPAWN, params))[0]
        if not spawned.held:
            await self.fence_failed(suspending=False)
        child = spawned.child_id
        if child is None:  # an earlier try committed after this statement's snapshot
            stored = (await self.calls.rows(self, CHECKPOINT, self.params(key)))[0]
            child = stored.value["task_id"]
        self.remember(key, "spawn", {"task_id": str(child)})
        return uuid.UUID(str(child))

    async def wait_for_result(
        self, key: StepKey, child_id: object, timeout: object
    ) -> ChildResult:
        child = parse_task_id(child_id, "child_id")
        seconds = None if timeout is None else check_delay("timeout", timeout)
        found, value = await self.replayed(key, "result")
        if found:
            return _child_result(value)
        self.retried = False
        params = {**self.params(key), "child_id": child, "timeout": seconds}

        async def register(connection: AsyncConnection) -> Row[Any] | str | None:
            locked = (await connection.execute(LOCK_FOR_WAIT, params)).first()
            if locked is None or locked.cancel:
                return None
            found = (await connection.execute(LOCK_CHILD, params)).first()
            if found is None or found.parent_id != self.lease.task_id:
                return "not a child"
            row: Row[Any] = (await connection.execute(REGISTER_RESULT_WAIT, params)).one()
            return row

        row = await self.calls.run(self, register, transaction=True)
        if isinstance(row, str):
            raise InvalidOptionError(
                "child_id", f"{child} is not a direct child of task {self.lease.task_id}"
            )
        if row is None or not row.held:
            await self.fence_failed(suspending=True)
        if row.waiting:
            if seconds is not None:
                self.calls.on_wait(seconds)
            self.suspend(f"waits for child {child} (step {key[0]!r})")
        self.remember(key, "result", row.value)
        return _child_result(row.value)

    # -- transactions and the bridge for synchronous handlers ------------------------------

    def transaction(self, key: StepKey) -> AsyncTransactionStep:
        return AsyncTransactionStep(self, key)

    def sync_transaction(self, key: StepKey) -> SyncTransactionStep:
        return SyncTransactionStep(self, key)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the worker's loop from a handler thread, and wait for it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coroutine.close()
            raise RuntimeError("a SyncTaskContext cannot be used on the worker's event loop")
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        except RuntimeError:  # the loop is closed: the worker is gone
            coroutine.close()
            raise LeaseLost("the worker stopped") from None
        while True:
            done, _ = concurrent.futures.wait([future], timeout=0.5)
            if done:
                break
            if self.loop.is_closed():
                future.cancel()
                raise LeaseLost("the worker stopped")
        if future.cancelled():  # the worker stopped and cancelled what ran on its loop
            raise LeaseLost("the worker stopped")
        return future.result()


def _signal_value(value: Any) -> Any:
    return None if value.get("timeout") else value.get("signal")


def _child_result(value: Any) -> ChildResult:
    return ChildResult(value["state"], value.get("result"), value.get("error"))

