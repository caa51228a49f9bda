"""Least-privilege roles at work: each level logs in as its own role (``grant_roles``), does
its job through the library, and is refused outside it (SQLSTATE 42501).

The four roles are made for each test with unique names (roles are cluster-wide) and dropped
afterwards (`tests.support.roles.login_roles`). The exact privileges, and that each of them is
needed, are `test_roles_matrix.py`'s business; the command line is `test_roles_cli.py`'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, delete, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import (
    EnqueueRequest,
    IdempotencyKey,
    InvalidNameError,
    InvalidOptionError,
    Queue,
    QueueFull,
    Registry,
    Task,
    TaskContext,
    WorkerOptions,
    WorkerRecord,
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
    wait_for_result,
)
from sqlalchemy_pgtask.audit import audit_statement, list_audit
from sqlalchemy_pgtask.durable.signals import emit_signal
from sqlalchemy_pgtask.grants import LEVELS, grant_roles, grant_roles_async, grants_sql
from sqlalchemy_pgtask.models import AuditEntry, Schedule
from sqlalchemy_pgtask.retention import run_retention
from sqlalchemy_pgtask.testing import DatabaseClock, running_worker, wait_until
from tests.support.durable import claim_one, complete
from tests.support.engines import engine_for
from tests.support.roles import (
    Roles,
    ddl,
    login_roles,
    privileges_of,
    quoted,
    refused,
    role_engine,
    role_url,
    sqlstate_of,
)
from tests.support.tasks import claim_parameters
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(
    lease_duration=2.0, heartbeat_interval=0.5, worker_ttl=2.0, shutdown_grace=2.0,
    worker_retention=60.0,
)


@pytest.fixture
def roles(pgtask_database_url: str) -> Iterator[Roles]:
    with login_roles(pgtask_database_url) as made:
        yield made


@pytest.fixture
def producer(pgtask_database_url: str, roles: Roles) -> Iterator[Engine]:
    with role_engine(pgtask_database_url, roles.producer) as engine:
        yield engine


@pytest.fixture
def observer(pgtask_database_url: str, roles: Roles) -> Iterator[Engine]:
    with role_engine(pgtask_database_url, roles.observer) as engine:
        yield engine


@pytest.fixture
def admin_engine(pgtask_database_url: str, roles: Roles) -> Iterator[Engine]:
    with role_engine(pgtask_database_url, roles.admin) as engine:
        yield engine


def _claim(connection: Connection) -> Any:
    params = claim_parameters(worker_id=uuid.uuid4(), lease=30.0)
    return connection.execute(statements.CLAIM, params).all()


def _finish(owner: Engine, task_id: uuid.UUID, state: str, days_ago: int = 0) -> None:
    with owner.begin() as connection:
        connection.execute(
            update(Task).where(Task.id == task_id).values(
                state=state, result={"done": True} if state == "succeeded" else None,
                error=None if state == "succeeded" else {"type": "handler_error"},
                completed_at=text(f"pgtask.now() - interval '{days_ago} days'"),
            )
        )


def _audit_changes(connection: Connection) -> list[Any]:
    return [
        lambda: connection.execute(update(AuditEntry).values(reason="rewritten")),
        lambda: connection.execute(delete(AuditEntry)),
        lambda: connection.exec_driver_sql("TRUNCATE pgtask.audit_log"),
    ]


# -- producer --------------------------------------------------------------------------------


def test_a_producer_enqueues_signals_and_reads_its_tasks(
    pgtask_engine: Engine, producer: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        configure_queue(owner, "limited", max_outstanding_tasks=1)
    with producer.begin() as connection:
        task_id = enqueue(connection, "job", {"n": 1}).id
        first = enqueue(connection, "job", idempotency_key="order-1")
        again = enqueue_many(connection, [EnqueueRequest(name="job", idempotency_key="order-1")])
        assert (again[0].id, again[0].created) == (first.id, False)
        enqueue(connection, "job", queue="limited")
        assert emit_signal(connection, task_id, "go", {"v": 1}) == {"v": 1}
        assert emit_signal(connection, task_id, "go", {"v": 2}) == {"v": 1}
    # The capacity trigger writes the counter for the producer, who may not.
    with pytest.raises(QueueFull), producer.begin() as connection:
        enqueue(connection, "job", queue="limited")
    with Session(producer) as session:
        task = get_task(session, task_id)
        assert task is not None
        assert task.payload == {"n": 1}
        assert task_id in {t.id for t in status.list_tasks(session.connection())}
    _finish(pgtask_engine, task_id, "succeeded")
    assert wait_for_result(producer, task_id, timeout=PATIENCE).result == {"done": True}


def test_a_producer_cannot_claim_change_or_configure(
    pgtask_engine: Engine, producer: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job").id
    refusals: list[Callable[[Connection], Any]] = [
        _claim,
        lambda c: c.execute(update(Task).where(Task.id == task_id).values(state="succeeded")),
        lambda c: c.execute(delete(Task).where(Task.id == task_id)),
        lambda c: cancel(c, task_id),
        lambda c: configure_queue(c, "default", paused=True),
        lambda c: c.execute(audit_statement("task.cancel", actor="me", task_id=task_id)),
        lambda c: c.execute(text("SELECT pgtask.admit(ARRAY['default'], ARRAY[1::bigint])")),
        lambda c: c.execute(text("SELECT pgtask.recount_outstanding('default')")),
        lambda c: c.execute(select(WorkerRecord)).all(),
    ]
    for refusal in refusals:
        with refused(), producer.begin() as connection:
            refusal(connection)


# -- worker ----------------------------------------------------------------------------------


def _dead_lease(owner: Engine) -> uuid.UUID:
    """A task claimed by a worker that died: running, its lease expired."""
    with owner.begin() as connection:
        task_id = enqueue(connection, "plain", "recovered").id
        connection.execute(
            update(Task).where(Task.id == task_id).values(
                state="running", attempt=1, max_attempts=3, lease_token=uuid.uuid4(),
                lease_owner=uuid.uuid4(),
                lease_expires_at=text("pgtask.now() - interval '1 minute'"),
            )
        )
    return task_id


def _gone_worker(owner: Engine) -> uuid.UUID:
    worker_id = uuid.uuid4()
    with owner.begin() as connection:
        connection.execute(
            insert(WorkerRecord).values(
                id=worker_id, queues=["default"], version="0", hostname="gone", pid=1,
                concurrency=1, draining=True, started_at=text("pgtask.now() - interval '2 days'"),
                heartbeat_at=text("pgtask.now() - interval '1 day'"),
                expires_at=text("pgtask.now() - interval '1 day'"),
            )
        )
    return worker_id


def _state(owner: Engine, task_id: uuid.UUID) -> Any:
    with owner.connect() as connection:
        return connection.execute(
            select(Task.state, Task.result).where(Task.id == task_id)
        ).one()


async def test_a_worker_runs_plain_and_durable_tasks_and_its_maintenance(
    pgtask_database_url: str, pgtask_engine: Engine, pgtask_clock: DatabaseClock,
    roles: Roles, producer: Engine,
) -> None:
    registry = Registry()

    @registry.task("plain", max_attempts=3)
    async def plain(ctx: TaskContext, payload: Any) -> Any:
        return payload

    @registry.task("child", max_attempts=1)
    async def child(ctx: TaskContext, payload: Any) -> Any:
        return {"child": payload}

    @registry.task("flow", max_attempts=1)
    async def flow(ctx: TaskContext, payload: Any) -> Any:
        first = await ctx.step("first", lambda: 1)
        await ctx.sleep_for("nap", 3600)
        approval = await ctx.wait_for_signal("approve", "approved")
        spawned = await ctx.spawn("spawn", child, first)
        result = await ctx.wait_for_result("wait", spawned)
        return [first, approval, result.state, result.result]

    @registry.task("impatient", max_attempts=1)
    async def impatient(ctx: TaskContext, payload: Any) -> Any:
        return await ctx.wait_for_signal("never", "never", timeout=60)

    with pgtask_engine.begin() as owner:
        # Claims go through the queue's rate-limit bucket; finishing releases capacity.
        configure_queue(
            owner, "default", rate_limit=1000, rate_period=1.0, max_outstanding_tasks=100
        )
    recovered, gone = _dead_lease(pgtask_engine), _gone_worker(pgtask_engine)
    with producer.begin() as connection:
        plain_id = enqueue(connection, "plain", "hello").id
        flow_id = enqueue(connection, "flow").id
        impatient_id = enqueue(connection, "impatient").id

    def state(task_id: uuid.UUID) -> str:
        return str(_state(pgtask_engine, task_id).state)

    async with running_worker(registry, role_url(pgtask_database_url, roles.worker), OPTIONS):
        await wait_until(lambda: state(plain_id) == "succeeded", PATIENCE, message="plain")
        with pgtask_engine.connect() as connection:
            logged_in = connection.execute(text(
                "SELECT DISTINCT usename FROM pg_stat_activity"
                " WHERE datname = current_database() AND usename <> current_user"
            )).scalars().all()
        assert logged_in == [roles.worker]  # every connection of the worker is its role's
        await wait_until(lambda: state(recovered) == "succeeded", PATIENCE, message="recovery")
        await wait_until(lambda: state(flow_id) == "pending", PATIENCE, message="sleeping")
        await wait_until(lambda: state(impatient_id) == "waiting", PATIENCE, message="waiting")
        pgtask_clock.advance(3601)  # ends the nap and the impatient wait
        await wait_until(lambda: state(flow_id) == "waiting", PATIENCE, message="signal wait")
        with producer.begin() as connection:
            emit_signal(connection, flow_id, "approved", "yes")
        await wait_until(lambda: state(flow_id) == "succeeded", PATIENCE, message="flow")
        await wait_until(lambda: state(impatient_id) == "succeeded", PATIENCE, message="timeout")

        def pruned() -> bool:
            with pgtask_engine.connect() as connection:
                return connection.execute(
                    select(WorkerRecord.id).where(WorkerRecord.id == gone)
                ).first() is None

        await wait_until(pruned, PATIENCE, message="the gone worker's row pruned")
    assert _state(pgtask_engine, flow_id).result == [1, "yes", "succeeded", {"child": 1}]
    assert _state(pgtask_engine, impatient_id).result is None
    with pgtask_engine.connect() as connection:
        [settings] = list_queues(connection)
    assert settings.outstanding_tasks == 0  # counted down by triggers the worker fired


def test_a_worker_materialises_schedules_and_runs_retention(
    pgtask_database_url: str, pgtask_engine: Engine, roles: Roles
) -> None:
    """What the worker's schedule and retention services run, as the worker's role."""
    with pgtask_engine.begin() as owner:
        schedule.set_schedule(owner, "hourly", task="job", every=3600.0)
        owner.execute(update(Schedule).values(next_run_at=text("pgtask.now()")))
        old = enqueue(owner, "job", idempotency_key="old").id
    _finish(pgtask_engine, old, "succeeded", days_ago=40)
    with role_engine(pgtask_database_url, roles.worker) as worker:
        report = schedule.materialize_schedules(worker)
        assert (report.created, report.failed) == (1, [])
        result = run_retention(worker)
    assert (result.tasks_deleted, result.keys_deleted) == (1, 1)
    with pgtask_engine.connect() as owner:
        [row] = owner.execute(select(Schedule.last_task_id, Schedule.last_error)).all()
        assert row.last_error is None
        assert owner.execute(select(Task.schedule_name).where(Task.id == row.last_task_id)
                             ).scalar_one() == "hourly"


def test_a_worker_cannot_audit_configure_or_rewrite_tasks(
    pgtask_database_url: str, pgtask_engine: Engine, roles: Roles
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job", "payload").id
    refusals: list[Callable[[Connection], Any]] = [
        lambda c: c.execute(audit_statement("task.cancel", actor="me", task_id=task_id)),
        lambda c: configure_queue(c, "default", paused=True),
        lambda c: c.execute(update(Task).where(Task.id == task_id).values(payload="forged")),
        lambda c: c.execute(update(Queue).values(outstanding_tasks=0)),
        lambda c: enqueue(c, "job", idempotency_key="k"),
        lambda c: emit_signal(c, task_id, "go"),
    ]
    with role_engine(pgtask_database_url, roles.worker) as worker:
        for refusal in refusals:
            with refused(), worker.begin() as connection:
                refusal(connection)


# -- observer --------------------------------------------------------------------------------


def test_an_observer_reads_status_tasks_queues_and_audit(
    pgtask_engine: Engine, observer: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job", {"n": 1}).id
        configure_queue(owner, "default", max_outstanding_tasks=10)
        cancel(owner, task_id, actor="ops", reason="test")
    with observer.connect() as connection:
        assert status.live_workers(connection) == []
        assert [q.name for q in status.queue_status(connection)] == ["default"]
        status.unroutable(connection)
        assert [t.id for t in status.list_tasks(connection)] == [task_id]
        detail = status.task_detail(connection, task_id)
        assert detail is not None
        assert detail.state == "cancelled"
        assert [q.name for q in list_queues(connection)] == ["default"]
        assert [e.action for e in list_audit(connection)] == ["task.cancel", "queue.configure"]
    with Session(observer) as session:
        assert get_task(session, task_id) is not None


def test_an_observer_writes_nothing(pgtask_engine: Engine, observer: Engine) -> None:
    with pgtask_engine.connect() as owner:
        tables = owner.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'pgtask' ORDER BY 1")
        ).scalars().all()
    assert "tasks" in tables
    for table in tables:
        with refused(), observer.begin() as connection:
            connection.exec_driver_sql(f"INSERT INTO pgtask.{table} DEFAULT VALUES")
        with refused(), observer.begin() as connection:
            connection.exec_driver_sql(f"DELETE FROM pgtask.{table}")
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job").id
    for refusal in (
        lambda c: enqueue(c, "job"),
        lambda c: cancel(c, task_id),
        lambda c: emit_signal(c, task_id, "go"),
        lambda c: configure_queue(c, "default", paused=True),
    ):
        with refused(), observer.begin() as connection:
            refusal(connection)


# -- admin -----------------------------------------------------------------------------------


def test_an_admin_cancels_retries_configures_and_runs_retention(
    pgtask_engine: Engine, admin_engine: Engine
) -> None:
    """The triggers an admin's changes fire (capacity counter, cascading cancellation, key
    expiry) write what the admin may not: they run as their owner."""
    with pgtask_engine.begin() as owner:
        configure_queue(owner, "default", max_outstanding_tasks=100)
        pending = enqueue(owner, "job").id
        failed = enqueue(owner, "job").id
        old = enqueue(owner, "job", idempotency_key="old-key").id
        parent, child = enqueue(owner, "job").id, enqueue(owner, "job").id
        owner.execute(update(Task).where(Task.id == child).values(parent_id=parent))
        owner.execute(update(Task).where(Task.id == parent).values(has_children=True))
    _finish(pgtask_engine, failed, "failed")
    # Past the 1-day history retention set below, within the 30-day key retention.
    _finish(pgtask_engine, old, "succeeded", days_ago=10)
    with admin_engine.begin() as connection:
        assert cancel(connection, pending, actor="ann", reason="duplicate") == "cancelled"
        assert cancel(connection, parent, actor="ann") == "cancelled"
        admin.retry(connection, failed, actor="ann")
        configure_queue(
            connection, "default", max_outstanding_tasks=50, terminal_retention_seconds=86_400,
            rate_limit=10, rate_period=1.0, starvation_timeout=60.0, actor="ann",
        )
        admin.pause_queue(connection, "default", actor="ann")
        admin.resume_queue(connection, "default", actor="ann")
    result = run_retention(admin_engine)
    assert result.tasks_deleted == 1
    assert _state(pgtask_engine, failed).state == "pending"
    assert _state(pgtask_engine, child).state == "cancelled"
    with pgtask_engine.connect() as owner:
        expiry = owner.execute(
            select(IdempotencyKey.expires_at).where(IdempotencyKey.key == "old-key")
        ).scalar_one()
    assert expiry is not None  # written down when its task was deleted, not released
    with admin_engine.connect() as connection:
        actions = [e.action for e in list_audit(connection)]
        [settings] = list_queues(connection)
    assert sorted(set(actions)) == [
        "queue.configure", "queue.pause", "queue.resume", "task.cancel", "task.retry",
    ]
    assert (settings.max_outstanding_tasks, settings.paused) == (50, False)
    assert settings.outstanding_tasks == 1  # the retried task


def test_retention_by_an_admin_deletes_attempts_it_has_no_privilege_on(
    pgtask_engine: Engine, admin_engine: Engine
) -> None:
    """Attempts go with their task through a trigger that runs as its owner (revision
    pgtask_0009): the admin may delete tasks, never touch attempts."""
    with pgtask_engine.connect() as owner:
        owner.execution_options(isolation_level="AUTOCOMMIT")
        old = enqueue(owner, "job").id
        lease = claim_one(owner)
        complete(owner, lease, "done")
    _finish(pgtask_engine, old, "succeeded", days_ago=10)
    with refused(), admin_engine.begin() as connection:
        connection.execute(text("DELETE FROM pgtask.attempts"))
    assert run_retention(admin_engine).tasks_deleted == 1
    with pgtask_engine.connect() as owner:
        left = owner.execute(
            text("SELECT count(*) FROM pgtask.attempts WHERE task_id = :t"), {"t": old}
        ).scalar_one()
    assert left == 0


def test_an_admin_cannot_claim_enqueue_or_forge_leases(
    pgtask_engine: Engine, admin_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job", "payload").id
    for refusal in (
        _claim,
        lambda c: enqueue(c, "job"),
        lambda c: c.execute(update(Task).where(Task.id == task_id).values(payload="forged")),
        lambda c: c.execute(update(Queue).values(outstanding_tasks=0)),
        lambda c: c.execute(pg_insert(Queue).values(name="q", outstanding_tasks=5)),
    ):
        with refused(), admin_engine.begin() as connection:
            refusal(connection)


def test_nobody_can_change_or_delete_the_audit_log(
    pgtask_database_url: str, pgtask_engine: Engine, roles: Roles
) -> None:
    with pgtask_engine.begin() as owner:
        owner.execute(audit_statement("queue.pause", actor="ann", queue="default"))
    for role in roles:
        with role_engine(pgtask_database_url, role) as engine:
            for index in range(3):
                with refused(), engine.begin() as connection:
                    _audit_changes(connection)[index]()
    with pgtask_engine.connect() as owner:
        assert owner.execute(select(AuditEntry.reason, AuditEntry.actor)).all() == [(None, "ann")]


# -- the grants themselves -------------------------------------------------------------------


def test_role_names_are_quoted_never_interpolated(pgtask_engine: Engine) -> None:
    name = f'pgtask "odd" %s :x; DROP TABLE pgtask.tasks; -- {uuid.uuid4().hex[:8]}'
    with pgtask_engine.connect() as connection:
        connection.begin()
        ddl(connection, f"CREATE ROLE {quoted(name)}")
        grant_roles(connection, observer=name)
        assert "tasks: SELECT" in privileges_of(connection, name)
        assert connection.execute(text("SELECT to_regclass('pgtask.tasks')")).scalar()
        assert quoted(name) in grants_sql(observer=name)
        connection.rollback()


@pytest.mark.parametrize(
    ("roles_given", "error"),
    [
        ({}, InvalidOptionError),
        ({"producer": "app", "worker": "app"}, InvalidOptionError),
        ({"producer": ""}, InvalidNameError),
        ({"producer": "public"}, InvalidNameError),
        ({"producer": "PUBLIC"}, InvalidNameError),
        ({"producer": "none"}, InvalidNameError),
        ({"observer": "pg_read_all_data"}, InvalidNameError),
        ({"admin": "x" * 64}, InvalidNameError),
        ({"admin": "a\x00b"}, InvalidNameError),
        ({"admin": " padded"}, InvalidNameError),
        ({"worker": 42}, InvalidNameError),
    ],
)
def test_bad_roles_are_refused_before_any_sql(
    pgtask_engine: Engine, roles_given: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        grants_sql(**roles_given)
    with pgtask_engine.connect() as connection:
        connection.begin()
        with pytest.raises(error):
            grant_roles(connection, **roles_given)
        # Nothing ran: the transaction is still usable.
        assert connection.execute(text("SELECT 1")).scalar() == 1
        connection.rollback()


def test_grants_join_the_callers_transaction(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with login_roles(pgtask_database_url, grant=False) as made:
        with pgtask_engine.connect() as connection:
            connection.begin()
            grant_roles(connection, **vars(made))
            assert "tasks: SELECT" in privileges_of(connection, made.observer)
            connection.rollback()
            assert "tasks: SELECT" not in privileges_of(connection, made.observer)
        with (
            role_engine(pgtask_database_url, made.producer) as engine,
            refused(),
            engine.begin() as connection,
        ):
            enqueue(connection, "job")


async def test_grant_roles_async_grants_the_same(pgtask_database_url: str) -> None:
    with login_roles(pgtask_database_url, grant=False) as made:
        engine = create_async_engine(pgtask_database_url)
        try:
            async with engine.begin() as connection:
                await grant_roles_async(connection, **vars(made))
        finally:
            await engine.dispose()
        with engine_for(pgtask_database_url) as owner, owner.connect() as connection:
            held = {level: privileges_of(connection, getattr(made, level)) for level in LEVELS}
        with (
            login_roles(pgtask_database_url) as reference,
            engine_for(pgtask_database_url) as owner,
            owner.connect() as connection,
        ):
            for level in LEVELS:
                assert held[level] == privileges_of(connection, getattr(reference, level))


def test_a_missing_role_is_a_database_error(pgtask_engine: Engine) -> None:
    with pytest.raises(DBAPIError) as caught, pgtask_engine.begin() as connection:
        grant_roles(connection, producer=f"missing_{uuid.uuid4().hex[:8]}")
    assert sqlstate_of(caught.value) == "42704"  # undefined_object


@pytest.mark.parametrize("level", LEVELS)
def test_the_documented_revoke_takes_every_privilege_away(
    pgtask_engine: Engine, level: str
) -> None:
    with pgtask_engine.connect() as connection:
        connection.begin()
        role = f"pgtask_revoked_{uuid.uuid4().hex[:8]}"
        ddl(connection, f"CREATE ROLE {role}")
        grant_roles(connection, **{level: role})
        assert privileges_of(connection, role)
        for statement in (  # as docs/roles.md says
            f"REVOKE ALL ON ALL TABLES IN SCHEMA pgtask FROM {role}",
            f"REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pgtask FROM {role}",
            f"REVOKE USAGE ON SCHEMA pgtask FROM {role}",
        ):
            ddl(connection, statement)
        assert privileges_of(connection, role) == set()
        connection.rollback()


def test_the_test_roles_are_dropped_afterwards(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    """Roles outlive test databases: `login_roles` must drop what it made."""
    with login_roles(pgtask_database_url) as made:
        names = list(made)
    with pgtask_engine.connect() as connection:
        left = connection.execute(
            text("SELECT rolname FROM pg_roles WHERE rolname = ANY(:names)"), {"names": names}
        ).scalars().all()
    assert left == []
