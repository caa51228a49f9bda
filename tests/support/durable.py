"""durable: run the durable statements as the worker runs them, and break connections around them.

Every helper executes the compiled statements of ``sqlalchemy_pgtask.statements`` with the
parameters the worker binds (`statements.durable_params` and the builders of
``statements.lease``), on a connection the caller gives, **without committing** (except
`complete_until_written`, which commits each try as the worker's completer does): the caller
decides whether the transaction commits, rolls back or dies. The sequences are the worker's
(``sqlalchemy_pgtask.worker._durable``): a signal wait is `statements.LOCK_FOR_WAIT` then
`statements.REGISTER_SIGNAL_WAIT` in one transaction; a result wait is ``LOCK_FOR_WAIT``,
``LOCK_CHILD``, ``REGISTER_RESULT_WAIT``.

* Tasks: `add_task`, `claim`, `claim_one`, `complete`, `complete_until_written`, `fail`,
  `recover`, `expire_lease`, `cancel_task`.
* Durable calls: `params`, `save_checkpoint`, `read_checkpoint`, `sleep`, `spawn`,
  `spawn_child`, `register_signal_wait` / `waiting_on_signal`, `register_result_wait` /
  `waiting_on_child`, `emit`, `wait_timeouts`, `make_wait_due`.
* Reading: `task_of`, `checkpoints_of`, `replay`, `wait_of`, `signals_of`, `snapshot`.
* Failures: `backend_pid`, `terminate`, `fail_before_commit`, `killed_before_commit`,
  `killed_after_commit`, `blocked_on_lock`, `Blocked` (a call run in a thread on its own
  connection, which must wait for a lock).
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Final, Generic, Literal, NamedTuple, TypeVar

import pytest
from sqlalchemy import Connection, Engine, Row, select, text
from sqlalchemy.exc import OperationalError

from sqlalchemy_pgtask import Checkpoint, Signal, Wait, cancel, enqueue
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.enqueue.plan import EnqueueRequest, new_ids, validate_request
from sqlalchemy_pgtask.outcome import error_document
from tests.support.tasks import claim_parameters, read_attempts, read_task
from tests.support.waiting import PATIENCE, wait_until

#: SQLSTATE lock_not_available: a ``NOWAIT`` lock found the row held.
LOCK_NOT_AVAILABLE: Final = "55P03"

__all__ = [
    "LEASE",
    "VERSION",
    "Blocked",
    "Failure",
    "Lease",
    "add_task",
    "backend_pid",
    "blocked_on_lock",
    "cancel_task",
    "checkpoints_of",
    "claim",
    "claim_one",
    "complete",
    "complete_until_written",
    "emit",
    "expire_lease",
    "fail",
    "fail_before_commit",
    "killed_after_commit",
    "killed_before_commit",
    "make_wait_due",
    "params",
    "read_checkpoint",
    "recover",
    "register_result_wait",
    "register_signal_wait",
    "replay",
    "save_checkpoint",
    "signals_of",
    "sleep",
    "snapshot",
    "spawn",
    "spawn_child",
    "task_of",
    "terminate",
    "wait_of",
    "wait_timeouts",
    "waiting_on_child",
    "waiting_on_signal",
]

Lease = st.Lease
LEASE: Final = 30.0
#: The handler version of every task here (the checkpoint key's version).
VERSION: Final = 1
WORKER: Final = uuid.UUID("00000000-0000-4000-8000-0000000000d1")

#: How a transaction fails before its COMMIT: rolled back by the client, or its backend killed.
Failure = Literal["rollback", "terminate"]

_T = TypeVar("_T")


# -- tasks -----------------------------------------------------------------------------------


def add_task(conn: Connection, name: str = "job", payload: Any = None, **options: Any) -> uuid.UUID:
    """Enqueue one task on ``conn`` (an autocommit connection commits it at once)."""
    return enqueue(conn, name, payload, **options).id


def claim(
    conn: Connection,
    name: str = "job",
    *,
    limit: int = 10,
    lease: float = LEASE,
    worker_id: uuid.UUID = WORKER,
    max_attempts: int = 5,
) -> list[st.Lease]:
    """Claim due tasks called ``name`` as a worker would; their leases, in claim order."""
    parameters = claim_parameters(
        worker_id=worker_id, lease=lease, identities=[(name, VERSION)], limit=limit,
        max_attempts=max_attempts,
    )
    return [Lease(r.id, r.attempt, r.lease_token) for r in conn.execute(st.CLAIM, parameters)]


def claim_one(conn: Connection, name: str = "job", **kwargs: Any) -> st.Lease:
    [lease] = claim(conn, name, limit=1, **kwargs)
    return lease


def complete(conn: Connection, lease: st.Lease, result: Any = None) -> list[tuple[Any, ...]]:
    params = st.complete_params([lease], [json.dumps(result)])
    return [tuple(row) for row in conn.execute(st.COMPLETE, params)]


def complete_until_written(
    conn: Connection, lease: st.Lease, result: Any = None, timeout: float = PATIENCE
) -> tuple[str, int]:
    """COMPLETE as the worker's completer does: a row another transaction holds is skipped
    by the statement, and a waiting parent another transaction holds makes it fail at once
    (SQLSTATE 55P03, trigger ``tasks_child_finished``); either way, try again until it is
    written or the lease is gone.

    Each try commits. Returns the state written (or ``"lost"``) and how many tries found a
    row locked.
    """
    skipped = 0

    def written() -> str | None:
        nonlocal skipped
        try:
            rows = complete(conn, lease, result)
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            conn.rollback()
            skipped += 1
            return None
        conn.commit()
        if rows:
            return str(rows[0][1])
        [held] = conn.execute(st.LEASES, {"ids": [lease.task_id]}).all()
        conn.commit()
        if (held.state, held.attempt, held.lease_token) != ("running", lease.attempt, lease.token):
            return "lost"
        skipped += 1
        return None

    state = wait_until(written, timeout, interval=0.001, message=f"COMPLETE of {lease.task_id}")
    assert state is not None
    return state, skipped


def fail(conn: Connection, lease: st.Lease, delay: float | None) -> list[tuple[Any, ...]]:
    document = error_document("handler_error", ValueError("boom"))
    params = st.fail_params([lease], [document], [delay])
    return [tuple(row) for row in conn.execute(st.FAIL, params)]


def recover(conn: Connection, limit: int = 100) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in conn.execute(st.RECOVER, {"limit": limit})]


def expire_lease(conn: Connection, task_id: uuid.UUID) -> None:
    """Move the lease's expiry into the past, in database time (nothing sleeps)."""
    conn.execute(
        text(
            "UPDATE pgtask.tasks SET lease_expires_at = pgtask.now() - interval '1 s'"
            " WHERE id = :id"
        ),
        {"id": task_id},
    )


def cancel_task(conn: Connection, task_id: uuid.UUID) -> str | None:
    return cancel(conn, task_id)


# -- durable calls ---------------------------------------------------------------------------


def params(lease: st.Lease, step: str, occurrence: int = 0) -> st.DurableParams:
    return st.durable_params(lease, VERSION, step, occurrence)


class Saved(NamedTuple):
    """What SAVE_CHECKPOINT answered, without the stored text (see `stored`)."""

    held: bool
    saved: bool


def save_checkpoint(
    conn: Connection, lease: st.Lease, step: str, value: Any, kind: str = "step"
) -> Saved:
    """SAVE_CHECKPOINT: ``(held, saved)``; what it says it stored must be ``value``."""
    bound = {**params(lease, step), "kind": kind, "value": json.dumps(value)}
    row = conn.execute(st.SAVE_CHECKPOINT, bound).one()
    if row.saved:
        assert row.stored == value
    else:
        assert row.stored is None
    return Saved(row.held, row.saved)


def read_checkpoint(conn: Connection, task_id: uuid.UUID, step: str) -> Row[Any, Any] | None:
    """CHECKPOINT (what the worker reads when its save found the key taken): ``(kind, value)``."""
    bound = {**params(Lease(task_id, 0, uuid.uuid4()), step)}
    return conn.execute(st.CHECKPOINT, bound).first()


def sleep(
    conn: Connection, lease: st.Lease, step: str, *, delay: float | None = None,
    wake_at: Any = None,
) -> Row[Any]:
    """SLEEP: ``(held, wake_at, suspended)``."""
    return conn.execute(st.SLEEP, {**params(lease, step), "delay": delay, "wake_at": wake_at}).one()


def spawn(
    conn: Connection, lease: st.Lease, step: str, name: str = "child", payload: Any = None,
    **options: Any,
) -> Row[Any]:
    """SPAWN, with the child's parameters made as the worker makes them: ``(held, child_id,
    created)``."""
    row = validate_request(EnqueueRequest(name=name, payload=payload, **options), new_ids(1)[0])
    bound = {
        **params(lease, step), "child_id": row.id, "child_queue": row.queue,
        "child_name": row.name, "child_version": row.version, "child_payload": row.payload,
        "child_headers": row.headers, "child_priority": row.priority,
        "child_max_attempts": row.max_attempts, "child_run_at": row.run_at,
        "child_delay": row.delay, "child_timeout": row.timeout,
        "child_concurrency_key": row.concurrency_key,
        "child_concurrency_limit": row.concurrency_limit,
    }
    return conn.execute(st.SPAWN, bound).one()


def spawn_child(conn: Connection, lease: st.Lease, step: str, name: str = "child") -> uuid.UUID:
    row = spawn(conn, lease, step, name)
    assert row.held
    return uuid.UUID(str(row.child_id))


def register_signal_wait(
    conn: Connection, lease: st.Lease, step: str, signal: str, *, signal_occurrence: int = 0,
    timeout: float | None = None,
) -> Row[Any] | None:
    """LOCK_FOR_WAIT then REGISTER_SIGNAL_WAIT in ``conn``'s transaction, as the worker does:
    ``(held, value, waiting)``, or None when the lock found no lease (or a cancel request)."""
    bound = {
        **params(lease, step), "signal": signal, "signal_occurrence": signal_occurrence,
        "timeout": timeout,
    }
    locked = conn.execute(st.LOCK_FOR_WAIT, bound).first()
    if locked is None or locked.cancel:
        return None
    return conn.execute(st.REGISTER_SIGNAL_WAIT, bound).one()


def register_result_wait(
    conn: Connection, lease: st.Lease, step: str, child_id: uuid.UUID, *,
    timeout: float | None = None,
) -> Row[Any] | None:
    """LOCK_FOR_WAIT, LOCK_CHILD, REGISTER_RESULT_WAIT in ``conn``'s transaction, as the worker
    does: ``(held, value, waiting)``, or None when the lock found no lease (or a cancel
    request). A child of another task is refused as the worker refuses it."""
    bound = {**params(lease, step), "child_id": child_id, "timeout": timeout}
    locked = conn.execute(st.LOCK_FOR_WAIT, bound).first()
    if locked is None or locked.cancel:
        return None
    found = conn.execute(st.LOCK_CHILD, bound).first()
    assert found is not None, "no such task"
    assert found.parent_id == lease.task_id, "not a direct child"
    return conn.execute(st.REGISTER_RESULT_WAIT, bound).one()


def waiting_on_signal(
    conn: Connection, lease: st.Lease, step: str, signal: str, **options: Any
) -> Row[Any]:
    """`register_signal_wait`, which must store the wait and suspend the attempt."""
    row = register_signal_wait(conn, lease, step, signal, **options)
    assert row is not None, "the lock found no lease"
    assert row.waiting, f"not suspended: {row}"
    return row


def waiting_on_child(
    conn: Connection, lease: st.Lease, step: str, child_id: uuid.UUID, **options: Any
) -> Row[Any]:
    """`register_result_wait`, which must store the wait and suspend the attempt."""
    row = register_result_wait(conn, lease, step, child_id, **options)
    assert row is not None, "the lock found no lease"
    assert row.waiting, f"not suspended: {row}"
    return row


def emit(
    conn: Connection, task_id: uuid.UUID, signal: str, value: Any, occurrence: int = 0
) -> Any:
    """EMIT_SIGNAL; returns the stored value (the first committed one wins)."""
    bound = {
        "task": task_id, "signal": signal, "signal_occurrence": occurrence,
        "signal_value": json.dumps(value),
    }
    return conn.execute(st.EMIT_SIGNAL, bound).scalar_one()


def wait_timeouts(conn: Connection, limit: int = 100) -> list[uuid.UUID]:
    """One pass of WAIT_TIMEOUTS; the ids of the tasks it woke (not those it found held)."""
    return [row.id for row in conn.execute(st.WAIT_TIMEOUTS, {"limit": limit}) if not row.held]


def make_wait_due(conn: Connection, task_id: uuid.UUID) -> None:
    """Move one wait's timeout into the past, in database time (nothing sleeps)."""
    conn.execute(
        text(
            "UPDATE pgtask.waits SET timeout_at = pgtask.now() - interval '1 s'"
            " WHERE task_id = :id"
        ),
        {"id": task_id},
    )


# -- reading ---------------------------------------------------------------------------------


def task_of(conn: Connection, task_id: uuid.UUID) -> dict[str, Any]:
    return read_task(conn, task_id)


def checkpoints_of(conn: Connection, task_id: uuid.UUID) -> dict[tuple[str, int], Any]:
    """Every checkpoint of a task: ``{(step, occurrence): (kind, value)}``."""
    rows = conn.execute(
        select(Checkpoint.step, Checkpoint.occurrence, Checkpoint.kind, Checkpoint.value)
        .where(Checkpoint.task_id == task_id)
    )
    return {(r.step, r.occurrence): (r.kind, r.value) for r in rows}


def replay(conn: Connection, task_id: uuid.UUID) -> dict[tuple[str, int], Any]:
    """What a replaying attempt reads at its first durable call (CHECKPOINTS)."""
    rows = conn.execute(st.CHECKPOINTS, {"task": task_id, "handler_version": VERSION})
    return {(r.step, r.occurrence): (r.kind, r.value) for r in rows}


def wait_of(conn: Connection, task_id: uuid.UUID) -> dict[str, Any] | None:
    row = conn.execute(select(Wait.__table__).where(Wait.task_id == task_id)).mappings().first()
    return None if row is None else dict(row)


def signals_of(conn: Connection, task_id: uuid.UUID) -> dict[tuple[str, int], Any]:
    rows = conn.execute(
        select(Signal.name, Signal.occurrence, Signal.value).where(Signal.task_id == task_id)
    )
    return {(r.name, r.occurrence): r.value for r in rows}


def snapshot(conn: Connection, *task_ids: uuid.UUID) -> list[Any]:
    """Everything stored about some tasks: rows, attempts, checkpoints, wait, signals."""
    return [
        (
            task_of(conn, task_id), read_attempts(conn, task_id), checkpoints_of(conn, task_id),
            wait_of(conn, task_id), signals_of(conn, task_id),
        )
        for task_id in task_ids
    ]


# -- failures --------------------------------------------------------------------------------


def backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def terminate(killer: Connection, pid: int) -> None:
    """Kill a backend (as a crash or a network cut would end it) and wait until it is gone."""
    gone = killer.execute(
        text("SELECT pg_terminate_backend(:pid, :ms)"), {"pid": pid, "ms": int(PATIENCE * 1000)}
    ).scalar_one()
    assert gone, f"backend {pid} did not terminate"


def fail_before_commit(conn: Connection, pid: int, failure: Failure, killer: Connection) -> None:
    """End ``conn``'s open transaction without its COMMIT: a rollback, or its backend ``pid``
    killed (the COMMIT the client then sends fails, and nothing of the transaction remains)."""
    if failure == "rollback":
        conn.rollback()
        return
    terminate(killer, pid)
    with pytest.raises(OperationalError) as raised:
        conn.commit()
    assert raised.value.connection_invalidated


@contextlib.contextmanager
def killed_before_commit(
    engine: Engine, killer: Connection, failure: Failure = "terminate"
) -> Iterator[Connection]:
    """A connection whose transaction runs the block and then fails before its COMMIT."""
    with engine.connect() as conn:
        pid = backend_pid(conn)
        yield conn
        fail_before_commit(conn, pid, failure, killer)


@contextlib.contextmanager
def killed_after_commit(engine: Engine, killer: Connection) -> Iterator[Connection]:
    """A connection whose transaction runs the block, commits, and then loses its backend:
    the client cannot use it again (and a real client would not know whether it committed)."""
    with engine.connect() as conn:
        pid = backend_pid(conn)
        yield conn
        conn.commit()
        terminate(killer, pid)
        with pytest.raises(OperationalError):
            conn.execute(text("SELECT 1"))


def blocked_on_lock(observer: Connection, pid: int) -> bool:
    """Whether backend ``pid`` is waiting for a lock (a row lock, a transaction id)."""
    event = observer.execute(
        text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
    ).scalar_one_or_none()
    return event == "Lock"


class Blocked(Generic[_T]):
    """A call run in its own thread on its own connection, which must wait for a lock.

    ``Blocked(engine, observer, fn)`` starts ``fn(conn)`` (in a transaction committed after
    ``fn`` returns) and returns once its backend waits for a lock; `result` joins the thread
    and returns what ``fn`` returned (or raises what it raised).
    """

    def __init__(
        self, engine: Engine, observer: Connection, fn: Callable[[Connection], _T]
    ) -> None:
        self._value: list[_T] = []
        self._error: list[BaseException] = []
        started = threading.Event()
        pid: list[int] = []

        def run() -> None:
            try:
                with engine.connect() as conn:
                    pid.append(backend_pid(conn))
                    started.set()
                    self._value.append(fn(conn))
                    conn.commit()
            except BaseException as exc:
                self._error.append(exc)
            finally:
                started.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(PATIENCE)
        assert pid, self._error
        self.pid = pid[0]
        wait_until(
            lambda: blocked_on_lock(observer, self.pid) or not self._thread.is_alive(),
            PATIENCE, message=f"backend {self.pid} waiting for a lock",
        )
        assert self._thread.is_alive(), f"did not wait for a lock: {self._error or self._value}"

    def result(self) -> _T:
        self._thread.join(PATIENCE)
        assert not self._thread.is_alive(), "still blocked"
        if self._error:
            raise self._error[0]
        return self._value[0]
