"""roles: least-privilege login roles in a test database, what the catalog says each may do,
and the refusals to expect; never shared between tests.

Roles are cluster-wide while test databases are not: every role made here has a unique name
and is dropped (with its privileges in the test database) when the test ends.

* `login_roles` creates one LOGIN role per level, grants them with `grant_roles`, and drops
  them afterwards; `role_url` and `role_engine` log in as one of them (trust auth).
* `temporary_role` makes a role inside the caller's transaction (gone at its rollback), and
  `acting_as` runs a block as that role (``SET LOCAL ROLE``); `ddl` runs a statement with a
  quoted name verbatim.
* `privileges_of` reads every privilege a role holds on the pgtask schema from the catalog;
  `expand` turns a compact expectation into the same form.
* `sqlstate_of`, `refused` and `attempt` recognise PostgreSQL's "permission denied" (SQLSTATE
  42501).
* `JOBS` is each level's job as the statements and calls the library makes for it, and
  `run_job` runs one as a role after `prepare` (see the section below).
"""

from __future__ import annotations

import contextlib
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import (
    Connection,
    Engine,
    create_engine,
    literal_column,
    make_url,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sqlalchemy_pgtask import (
    EnqueueRequest,
    IdempotencyKey,
    Queue,
    Registry,
    RetryPolicy,
    Task,
    TaskDefinition,
    admin,
    cancel,
    configure_queue,
    enqueue,
    enqueue_many,
    get_task,
    list_queues,
    schedule,
    statements,
    status,
)
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.dashboard._task_list import TaskFilters, task_page
from sqlalchemy_pgtask.durable.signals import emit_signal
from sqlalchemy_pgtask.grants import LEVELS, grant_roles
from sqlalchemy_pgtask.models import Schedule
from sqlalchemy_pgtask.schedule.api import write_declared
from sqlalchemy_pgtask.statements import NOW, retention
from sqlalchemy_pgtask.statements import schedule as schedule_statements
from sqlalchemy_pgtask.statements.rescue import RESCUE, WORKER_LOCKS
from tests.support import durable

__all__ = [
    "DENIED",
    "JOBS",
    "JobFixture",
    "Roles",
    "acting_as",
    "attempt",
    "ddl",
    "expand",
    "login_roles",
    "prepare",
    "privileges_of",
    "quoted",
    "refused",
    "role_engine",
    "role_url",
    "run_job",
    "sqlstate_of",
    "temporary_role",
]

#: SQLSTATE insufficient_privilege.
DENIED: Final = "42501"

def ddl(connection: Connection, statement: str) -> None:
    """Run ``statement`` as it is (no parameters: a ``%`` in a role name stays a ``%``)."""
    connection.exec_driver_sql(statement, execution_options={"no_parameters": True})


def quoted(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return sql.Identifier(name).as_string(None)


@dataclass(frozen=True)
class Roles:
    """One role name per level."""

    producer: str
    worker: str
    observer: str
    admin: str

    def __iter__(self) -> Iterator[str]:
        return iter(astuple(self))


def role_url(database_url: str, role: str) -> str:
    """``database_url`` logged in as ``role`` (no password: the test server trusts)."""
    url = make_url(database_url).set(username=role, password=None)
    return url.render_as_string(hide_password=False)


def _drop(connection: Connection, names: Iterable[str]) -> None:
    for name in names:
        connection.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"),
            {"r": name},
        )
        exists = text("SELECT 1 FROM pg_roles WHERE rolname = :r")
        if connection.execute(exists, {"r": name}).first() is not None:
            # DROP OWNED revokes what it holds in this database: nothing elsewhere.
            ddl(connection, f"DROP OWNED BY {quoted(name)}")
            ddl(connection, f"DROP ROLE {quoted(name)}")


@contextlib.contextmanager
def login_roles(database_url: str, *, grant: bool = True) -> Iterator[Roles]:
    """Four new LOGIN roles (granted their levels unless ``grant`` is false); dropped after."""
    suffix = uuid.uuid4().hex[:12]
    roles = Roles(*(f"pgtask_test_{level}_{suffix}" for level in LEVELS))
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            for name in roles:
                ddl(connection, f"CREATE ROLE {quoted(name)} LOGIN")
            if grant:
                grant_roles(connection, **vars(roles))
        yield roles
    finally:
        with engine.begin() as connection:
            _drop(connection, roles)
        engine.dispose()


@contextlib.contextmanager
def role_engine(database_url: str, role: str) -> Iterator[Engine]:
    """An engine on the test database logged in as ``role``."""
    engine = create_engine(role_url(database_url, role), poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


def temporary_role(connection: Connection, level: str) -> str:
    """A new role with no login, in ``connection``'s transaction (gone when it rolls back)."""
    name = f"pgtask_tmp_{level}_{uuid.uuid4().hex[:12]}"
    ddl(connection, f"CREATE ROLE {quoted(name)}")
    return name


@contextlib.contextmanager
def acting_as(connection: Connection, role: str) -> Iterator[Connection]:
    """Run the block as ``role`` (``SET LOCAL ROLE``), in ``connection``'s transaction."""
    ddl(connection, f"SET LOCAL ROLE {quoted(role)}")
    try:
        yield connection
    finally:
        ddl(connection, "RESET ROLE")


def sqlstate_of(error: BaseException | None) -> str | None:
    """The SQLSTATE of a database error, through SQLAlchemy's and the library's wrapping."""
    seen = 0
    while error is not None and seen < 10:
        state = getattr(error, "sqlstate", None) or getattr(getattr(error, "orig", None),
                                                             "sqlstate", None)
        if state:
            return str(state)
        error = error.__cause__ or error.__context__
        seen += 1
    return None


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """The block must fail with "permission denied" (SQLSTATE 42501), nothing else."""
    with pytest.raises((DBAPIError, psycopg.Error)) as caught:
        yield
    assert sqlstate_of(caught.value) == DENIED, f"not a permission error: {caught.value!r}"


def attempt(connection: Connection, action: Callable[[Connection], Any]) -> str | None:
    """Run ``action`` in a savepoint; None if it worked, else the SQLSTATE it failed with
    (``"?"`` for an error without one), the savepoint rolled back."""
    try:
        with connection.begin_nested():
            action(connection)
    except Exception as exc:  # any failure is the answer; its SQLSTATE says which
        return sqlstate_of(exc) or f"? {exc!r}"
    return None


_PRIVILEGES: Final = text(
    """
    WITH r AS (SELECT CAST(:role AS name) AS role),
    rel AS (
        SELECT c.oid, c.relname, c.relkind FROM pg_class AS c
        WHERE c.relnamespace = CAST('pgtask' AS regnamespace)
    )
    SELECT rel.relname || ': ' || p.priv
    FROM r, rel, unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',
                              'REFERENCES', 'TRIGGER']) AS p(priv)
    WHERE rel.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND has_table_privilege(r.role, rel.oid, p.priv)
    UNION ALL
    SELECT rel.relname || ': ' || p.priv || ' (' || a.attname || ')'
    FROM r, rel
    JOIN pg_attribute AS a ON a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped,
    unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'REFERENCES']) AS p(priv)
    WHERE rel.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND has_column_privilege(r.role, rel.oid, a.attnum, p.priv)
      AND NOT has_table_privilege(r.role, rel.oid, p.priv)
    UNION ALL
    SELECT 'sequence ' || rel.relname || ': ' || p.priv
    FROM r, rel, unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) AS p(priv)
    WHERE rel.relkind = 'S' AND has_sequence_privilege(r.role, rel.oid, p.priv)
    UNION ALL
    SELECT 'function ' || CAST(CAST(f.oid AS regprocedure) AS text) || ': EXECUTE'
    FROM r, pg_proc AS f
    WHERE f.pronamespace = CAST('pgtask' AS regnamespace)
      AND has_function_privilege(r.role, f.oid, 'EXECUTE')
    UNION ALL
    SELECT 'schema pgtask: ' || p.priv
    FROM r, unnest(ARRAY['USAGE', 'CREATE']) AS p(priv)
    WHERE has_schema_privilege(r.role, 'pgtask', p.priv)
    """
)


def privileges_of(connection: Connection, role: str) -> set[str]:
    """Every privilege ``role`` holds on schema pgtask, its tables (whole, or else column by
    column), sequences and functions, directly, through PUBLIC or a role it belongs to:
    ``"tasks: SELECT"``, ``"tasks: INSERT (payload)"``, ``"function pgtask.now(): EXECUTE"``,
    ``"schema pgtask: USAGE"``, ``"sequence audit_log_id_seq: USAGE"``."""
    return {str(row[0]) for row in connection.execute(_PRIVILEGES, {"role": role})}


def expand(spec: Iterable[str]) -> set[str]:
    """``"tasks: INSERT (id queue)"`` as ``{"tasks: INSERT (id)", "tasks: INSERT (queue)"}``;
    anything else as it is."""
    expanded: set[str] = set()
    for item in spec:
        head, _, columns = item.partition(" (")
        if not columns:
            expanded.add(item)
            continue
        expanded.update(f"{head} ({column})" for column in columns.rstrip(")").split())
    return expanded


# -- each level's job, as the statements the library runs for it ------------------------------
#
# A job is a list of (name, action) run as the role (`acting_as`) on one connection, each in a
# savepoint (`attempt`). PostgreSQL checks a statement's privileges before it touches a row,
# so every action checks all of its statements' privileges whatever the data; `prepare` (run
# as the owner first) gives the actions rows to work on all the same. Actions that stand in
# for an API not written yet say so: they run the table operation that API will run.


@dataclass
class JobFixture:
    """The rows `prepare` made, and the leases the worker's job claimed."""

    task_id: uuid.UUID
    failed_id: uuid.UUID
    leases: list[Any]


Action = Callable[[Connection, JobFixture], Any]

QUEUE: Final = "default"
LIMITED_QUEUE: Final = "limited"
EXPIRED_KEY: Final = "expired-key"
_CAPABILITY: Final = statements.Capability(QUEUE, "job", 1, RetryPolicy.fixed(1.0), 5)
_LIMITED_CAPABILITY: Final = statements.Capability(
    LIMITED_QUEUE, "job", 1, RetryPolicy.fixed(1.0), 5
)
_WORKER_ID: Final = uuid.UUID("00000000-0000-4000-8000-00000000a11c")


def prepare(owner: Connection) -> JobFixture:
    """As the owner: a queue row, a capacity- and rate-limited queue, tasks to claim, a failed
    task finished long ago, an expired idempotency reservation and a schedule."""
    owner.execute(pg_insert(Queue).values(name=QUEUE).on_conflict_do_nothing())
    configure_queue(
        owner, LIMITED_QUEUE, max_outstanding_tasks=100, rate_limit=100, rate_period=1.0
    )
    enqueue(owner, "job", queue=LIMITED_QUEUE)
    task_id = enqueue(owner, "other").id
    for _ in range(6):
        enqueue(owner, "job")
    failed_id = enqueue(owner, "other").id
    owner.execute(
        update(Task).where(Task.id == failed_id).values(
            state="failed", completed_at=NOW - literal_column("interval '400 days'"),
            error={"type": "handler_error"},
        )
    )
    owner.execute(
        pg_insert(IdempotencyKey).values(
            queue=QUEUE, key=EXPIRED_KEY, task_id=uuid.uuid4(),
            expires_at=NOW - literal_column("interval '1 day'"),
        )
    )
    owner.execute(_schedule_upsert("nightly"))
    return JobFixture(task_id=task_id, failed_id=failed_id, leases=[])


def _schedule_upsert(name: str) -> Any:
    statement = pg_insert(Schedule).values(
        name=name, interval_seconds=3600.0, queue=QUEUE, task_name="job", declared=True,
        next_run_at=NOW,
    )
    return statement.on_conflict_do_update(
        index_elements=[Schedule.name],
        set_={"interval_seconds": statement.excluded.interval_seconds, "updated_at": NOW},
    )


def _get_task(connection: Connection, task_id: uuid.UUID) -> Any:
    with Session(bind=connection) as session:
        return get_task(session, task_id)


# producer


def _enqueue_with_keys(c: Connection, f: JobFixture) -> Any:
    return enqueue_many(
        c, [EnqueueRequest(name="job", idempotency_key=key) for key in ("k-1", "k-2", "k-1")]
    )


PRODUCER_JOB: Final[list[tuple[str, Action]]] = [
    ("enqueue", lambda c, f: enqueue(c, "job", {"n": 1})),
    ("enqueue_many with idempotency keys", _enqueue_with_keys),
    ("take over an expired key", lambda c, f: enqueue(c, "job", idempotency_key=EXPIRED_KEY)),
    ("enqueue into a capacity-limited queue", lambda c, f: enqueue(c, "job", queue=LIMITED_QUEUE)),
    ("emit a signal", lambda c, f: emit_signal(c, f.task_id, "go", 1)),
    ("get_task", lambda c, f: _get_task(c, f.task_id)),
    ("list tasks", lambda c, f: status.list_tasks(c)),
]

# worker


def _register(c: Connection, f: JobFixture) -> None:
    c.execute(statements.REGISTER_POLICIES, statements.policy_params([_CAPABILITY]))
    c.execute(statements.STORED_POLICIES, statements.identity_params([_CAPABILITY])).all()
    c.execute(statements.REGISTER_WORKER, {
        "worker_id": _WORKER_ID, "queues": [QUEUE], "version": "test", "hostname": "h",
        "pid": 1, "concurrency": 4, "ttl_seconds": 30.0, "lock_key": 17,
    })
    c.execute(statements.CLEAR_CAPABILITIES, {"worker_id": _WORKER_ID})
    c.execute(statements.ADD_CAPABILITIES,
              {"worker_id": _WORKER_ID, **statements.identity_params([_CAPABILITY])})
    c.execute(statements.HEARTBEAT,
              {"worker_id": _WORKER_ID, "ttl_seconds": 30.0, "draining": False}).all()


def _capabilities() -> statements.CapabilityParams:
    return statements.capability_params([QUEUE], [_CAPABILITY])


def _claim(c: Connection, f: JobFixture) -> None:
    params = statements.claim_params(
        _capabilities(), worker_id=_WORKER_ID, lease_seconds=30.0, limit=6
    )
    f.leases[:] = [statements.Lease(r.id, r.attempt, r.lease_token)
                   for r in c.execute(statements.CLAIM, params)]


def _claim_governed(c: Connection, f: JobFixture) -> None:
    """The claim of a worker serving a rate-limited queue (its token bucket)."""
    params = statements.claim_params(
        statements.capability_params([LIMITED_QUEUE], [_LIMITED_CAPABILITY]),
        worker_id=_WORKER_ID, lease_seconds=30.0, limit=1,
    )
    c.execute(statements.CLAIM_GOVERNED, params).all()


def _lease(f: JobFixture, index: int) -> Any:
    """A claimed lease, or a made-up one when the claim was refused (its statements are still
    checked for privileges; they then write nothing)."""
    if index < len(f.leases):
        return f.leases[index]
    return statements.Lease(uuid.uuid4(), 1, uuid.uuid4())


def _leases(c: Connection, f: JobFixture) -> None:
    c.execute(statements.SECONDS_UNTIL_DUE, _capabilities()).all()
    c.execute(statements.OWNED, {"worker_id": _WORKER_ID}).all()
    c.execute(statements.LEASES, {"ids": [_lease(f, 0).task_id]}).all()
    c.execute(statements.RENEW, statements.renew_params([_lease(f, 0)], 30.0)).all()


def _checkpoint(c: Connection, f: JobFixture) -> None:
    lease = _lease(f, 0)
    durable.save_checkpoint(c, lease, "step-1", {"ok": True})
    c.execute(statements.CHECKPOINTS, {"task": lease.task_id, "handler_version": 1}).all()
    durable.read_checkpoint(c, lease.task_id, "step-1")
    c.execute(statements.FENCE_STATE, {"task": lease.task_id}).all()


def _child(c: Connection, f: JobFixture) -> None:
    lease = _lease(f, 0)
    row = durable.spawn(c, lease, "child-1", name="job")
    if row.child_id is not None:
        durable.register_result_wait(c, lease, "wait-1", uuid.UUID(str(row.child_id)), timeout=60)


def _outcomes(c: Connection, f: JobFixture) -> None:
    durable.complete(c, _lease(f, 3))
    durable.fail(c, _lease(f, 4), 1.0)
    c.execute(statements.RELEASE, statements.release_params([_lease(f, 5)])).all()


def _maintenance(c: Connection, f: JobFixture) -> None:
    durable.recover(c)
    c.execute(WORKER_LOCKS).all()
    c.execute(RESCUE, {"owners": [_WORKER_ID], "limit": 10}).all()
    durable.wait_timeouts(c)
    c.execute(statements.NEXT_WAIT_TIMEOUT).all()
    c.execute(statements.PRUNE_WORKERS, {"retention_seconds": 0.0, "limit": 10}).all()


def _retention(c: Connection, f: JobFixture) -> None:
    c.execute(retention.DELETE_FINISHED_TASKS, {"queue": None, "limit": 10}).all()
    c.execute(retention.DELETE_EXPIRED_KEYS, {"queue": None, "limit": 10}).all()
    c.execute(
        retention.FINISHED_QUEUES, {"queue": None, "cursor_queues": [], "cursor_afters": []}
    ).all()
    c.execute(
        retention.DELETE_FINISHED_KEYS, {"queue": QUEUE, "after": None, "scan_limit": 10}
    ).all()


def _materialize(c: Connection, f: JobFixture) -> None:
    """The worker's materialiser, statement by statement: `materialize_schedules` records a
    refused insert as the schedule's ``last_error`` instead of raising it."""
    due = c.execute(
        schedule_statements.DUE_SCHEDULES, {"now": _now(c), "limit": 10, "exclude": []}
    ).all()
    assert due, "no due schedule to materialise"
    for row in due:
        c.execute(schedule_statements.MATERIALIZE, {
            "schedule": row.name, "ids": [uuid.uuid4()], "occurrences": [row.next_run_at],
            "cursor": row.next_run_at + timedelta(hours=1), "last": row.next_run_at,
        }).all()
        c.execute(schedule_statements.ADVANCE, {
            "schedule": row.name, "cursor": row.next_run_at + timedelta(hours=2), "error": None,
        })
        c.execute(schedule_statements.NOTE_ERROR, {"schedule": row.name, "error": None})
    c.execute(schedule_statements.SECONDS_UNTIL_NEXT_SCHEDULE, {"exclude": []}).all()


def _reconcile(c: Connection, f: JobFixture) -> None:
    """`reconcile_schedules`' writes: a new declared schedule, and a changed one."""
    registry = Registry()
    job: TaskDefinition[Any, Any] = registry.task("job", queue=QUEUE)(lambda ctx, payload: None)
    registry.schedule("declared", every=60.0)(job)
    registry.schedule("nightly", every=90.0)(job)
    for declared in registry.schedules:
        write_declared(c, declared.spec)


def _now(c: Connection) -> datetime:
    return typing.cast(datetime, c.execute(select(NOW)).scalar_one())


def _retire(c: Connection, f: JobFixture) -> None:
    c.execute(statements.RETIRE_WORKER, {"worker_id": _WORKER_ID})


WORKER_JOB: Final[list[tuple[str, Action]]] = [
    ("register", _register),
    ("claim", _claim),
    ("claim from a rate-limited queue", _claim_governed),
    ("leases", _leases),
    ("checkpoints", _checkpoint),
    ("spawn a child and wait for it", _child),
    ("sleep", lambda c, f: durable.sleep(c, _lease(f, 1), "nap", delay=60.0)),
    ("wait for a signal", lambda c, f: durable.register_signal_wait(
        c, _lease(f, 2), "signal-1", "go", timeout=60.0)),
    ("outcomes", _outcomes),
    ("maintenance", _maintenance),
    ("retention", _retention),
    ("materialise schedules", _materialize),
    ("reconcile declared schedules", _reconcile),
    ("retire", _retire),
]

# observer


OBSERVER_JOB: Final[list[tuple[str, Action]]] = [
    ("live workers", lambda c, f: status.live_workers(c)),
    ("queue status", lambda c, f: status.queue_status(c)),
    ("unroutable", lambda c, f: status.unroutable(c)),
    ("list tasks", lambda c, f: status.list_tasks(c)),
    ("task detail", lambda c, f: status.task_detail(c, f.task_id)),
    ("get_task", lambda c, f: _get_task(c, f.task_id)),
    ("list queues", lambda c, f: list_queues(c)),
    ("list audit", lambda c, f: list_audit(c)),
    ("list schedules", lambda c, f: schedule.list_schedules(c)),
    ("dashboard task search by idempotency key", lambda c, f: task_page(
        c, TaskFilters(search=EXPIRED_KEY), limit=10, after=None)),
]

# admin


def _configure(c: Connection, f: JobFixture) -> None:
    options: dict[str, Any] = {
        "max_outstanding_tasks": 50, "terminal_retention_seconds": 60,
        "idempotency_retention_seconds": 60, "paused": True, "rate_limit": 10,
        "rate_period": 1.0, "starvation_timeout": 30.0,
    }
    configure_queue(c, "fresh", **options)  # creates the row
    configure_queue(c, QUEUE, **options)  # changes it


def _admin_schedules(c: Connection, f: JobFixture) -> None:
    schedule.set_schedule(c, "weekly", task="job", every=3600.0, actor="ops")
    schedule.set_schedule(c, "weekly", task="job", every=7200.0, actor="ops")
    schedule.pause_schedule(c, "weekly", actor="ops")
    schedule.resume_schedule(c, "weekly", actor="ops")
    schedule.delete_schedule(c, "weekly", actor="ops")


ADMIN_JOB: Final[list[tuple[str, Action]]] = [
    *OBSERVER_JOB,
    ("cancel", lambda c, f: cancel(c, f.task_id, actor="ops", reason="test")),
    ("retry", lambda c, f: admin.retry(c, f.failed_id, actor="ops")),
    ("configure queues", _configure),
    ("pause and resume", lambda c, f: (admin.pause_queue(c, QUEUE), admin.resume_queue(c, QUEUE))),
    ("retention", _retention),
    ("prune workers", lambda c, f: c.execute(
        statements.PRUNE_WORKERS, {"retention_seconds": 0.0, "limit": 10}).all()),
    ("schedules", _admin_schedules),
]

JOBS: Final[dict[str, list[tuple[str, Action]]]] = {
    "producer": PRODUCER_JOB,
    "worker": WORKER_JOB,
    "observer": OBSERVER_JOB,
    "admin": ADMIN_JOB,
}


def run_job(connection: Connection, level: str, role: str) -> dict[str, str]:
    """`prepare` as the owner, then ``level``'s job as ``role``: the SQLSTATE of each action
    that failed, by name (empty: the whole job worked)."""
    fixture = prepare(connection)
    failures: dict[str, str] = {}
    with acting_as(connection, role):
        for name, action in JOBS[level]:

            def act(c: Connection, action: Action = action) -> Any:
                return action(c, fixture)

            state = attempt(connection, act)
            if state is not None:
                failures[name] = state
    return failures
