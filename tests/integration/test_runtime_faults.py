"""Worker defects found under faults (issue 6, part B), each proven with a real fault.

A claim whose commit outcome is unknown, an outcome write that loses its connection on its own,
a handler that raises ``CancelledError`` itself, an internal loop that fails, a cancelled
``Worker.run()``, the idle-poll race, a resumed queue, a listener that ignored the engine's
``connect_args``, and worker rows that were never pruned.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import Engine, make_url, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqlalchemy_pgtask import (
    Registry,
    RetryPolicy,
    SyncTaskContext,
    TaskContext,
    Worker,
    WorkerCrashed,
    WorkerOptions,
    WorkerRecord,
    configure_queue,
)
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.faultproxy import fault_proxy
from tests.support.tasks import add, attempt_rows, task_row, wait_for_state

FAST = WorkerOptions(lease_duration=1.5, poll_interval=30.0, shutdown_grace=2.0)


@pytest.fixture
def proxied_url(pgtask_database_url: str) -> tuple[str, str]:
    """(host, port) of this test's server, for a proxy in front of it."""
    url = make_url(pgtask_database_url)
    return str(url.host or "127.0.0.1"), str(url.port or 5432)


def through(pgtask_database_url: str, port: int) -> str:
    url = make_url(pgtask_database_url).set(host="127.0.0.1", port=port)
    return url.update_query_dict({"sslmode": "disable"}).render_as_string(hide_password=False)


# -- B3: a claim whose commit outcome is unknown ----------------------------------------------


async def test_a_claim_lost_after_its_commit_is_handed_back_and_runs_without_spending_an_attempt(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, proxied_url: tuple[str, str]
) -> None:
    registry = Registry()
    runs: list[int] = []

    @registry.task("once", max_attempts=1)
    async def once(ctx: TaskContext, payload: None) -> int:
        runs.append(ctx.attempt)
        return ctx.attempt

    task_id = await add(pgtask_async_engine, "once")
    host, port = proxied_url
    async with fault_proxy(host, int(port)) as proxy:
        # The claim commits on the server; its answer never reaches the worker.
        proxy.drop_after_commit(b"INSERT INTO pgtask.attempts")
        url = through(pgtask_database_url, proxy.port)
        async with running_worker(registry, url, FAST):
            await proxy.wait_dropped()
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=30)

    # A max_attempts=1 task must still run once: the unknown claim was released, not lost.
    assert (row["state"], row["failed_attempts"]) == ("succeeded", 0)
    assert runs == [row["attempt"]] == [2]
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == [
        "released", "succeeded",
    ]


# -- B5: an outcome written on its own loses its connection -----------------------------------


_FAULTS = """
CREATE SEQUENCE fault_once
---
CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'succeeded' THEN
        RAISE EXCEPTION 'this outcome is poison';
    END IF;
    RETURN NEW;
END $$
---
CREATE TRIGGER poison BEFORE UPDATE OF state ON pgtask.tasks
    FOR EACH ROW WHEN (NEW.id = '{poisoned}') EXECUTE FUNCTION poison()
---
-- Kills its own connection the first time the good outcome is written on its own.
CREATE FUNCTION drop_connection() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT count(*) FROM written) = 1
       AND EXISTS (SELECT 1 FROM written WHERE id = '{good}' AND state = 'succeeded')
       AND nextval('fault_once') = 1 THEN
        PERFORM pg_terminate_backend(pg_backend_pid());
    END IF;
    RETURN NULL;
END $$
---
CREATE TRIGGER drop_connection AFTER UPDATE ON pgtask.tasks
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION drop_connection()
"""


async def test_an_outcome_whose_own_write_loses_the_connection_is_written_again_not_forgotten(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    release = asyncio.Event()
    started: list[uuid.UUID] = []

    @registry.task("pair", retry=RetryPolicy.fixed(0.0, jitter=False), max_attempts=3)
    async def pair(ctx: TaskContext, payload: None) -> int:
        started.append(ctx.task_id)
        await release.wait()  # both finish in the same moment: one batch
        return ctx.attempt

    poisoned = await add(pgtask_async_engine, "pair")
    good = await add(pgtask_async_engine, "pair")
    async with pgtask_async_engine.begin() as conn:
        for statement in _FAULTS.format(poisoned=poisoned, good=good).split("---"):
            await conn.exec_driver_sql(statement)
    async with running_worker(registry, pgtask_database_url, FAST):
        await wait_until(lambda: len(started) == 2, message="both handlers to start")
        release.set()
        good_row = await wait_for_state(pgtask_async_engine, good)
        bad_row = await wait_for_state(pgtask_async_engine, poisoned)

    # The batch was refused (poison), the good outcome's own write lost its connection, and
    # it was written again: attempt 1 succeeded, no lease expired, nothing ran twice.
    assert (good_row["state"], good_row["attempt"], good_row["result"]) == ("succeeded", 1, 1)
    assert started.count(good) == 1
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, good)] == ["succeeded"]
    assert (bad_row["state"], bad_row["error"]["type"]) == ("failed", "outcome_rejected")


# -- B2: a handler that raises CancelledError itself -------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_handler_raising_cancelled_error_itself_is_a_failure_retried_by_policy(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, kind: str
) -> None:
    registry = Registry()
    retry = RetryPolicy.fixed(0.0, jitter=False)

    if kind == "async":

        @registry.task("gives-up", retry=retry, max_attempts=2)
        async def gives_up(ctx: TaskContext, payload: None) -> str:
            if ctx.attempt == 1:
                raise asyncio.CancelledError("the handler gave up on its own")
            return "second time lucky"

    else:

        @registry.task("gives-up", retry=retry, max_attempts=2)
        def gives_up_sync(ctx: SyncTaskContext, payload: None) -> str:
            if ctx.attempt == 1:
                raise asyncio.CancelledError("the handler gave up on its own")
            return "second time lucky"

    task_id = await add(pgtask_async_engine, "gives-up")
    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        row = await wait_for_state(pgtask_async_engine, task_id)
        await wait_until(lambda: worker.running_count == 0, message="the slot to be free")

    assert (row["state"], row["attempt"], row["failed_attempts"]) == ("succeeded", 2, 1)
    first, _ = await attempt_rows(pgtask_async_engine, task_id)
    assert first["state"] == "failed"
    assert first["error"]["type"] == "handler_error"
    assert first["error"]["exception"] == "asyncio.exceptions.CancelledError"


# -- B4: supervision -------------------------------------------------------------------------


def _live_loops() -> list[str]:
    return sorted(
        t.get_name() for t in asyncio.all_tasks()
        if t.get_name().startswith("pgtask-") and not t.done()
    )


async def test_cancelling_run_stops_every_loop_and_hands_running_tasks_back(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    registry = Registry()
    started = asyncio.Event()

    @registry.task("long")
    async def long(ctx: TaskContext, payload: None) -> None:
        started.set()
        await asyncio.sleep(3600)

    task_id = await add(pgtask_async_engine, "long")
    worker = Worker(registry, pgtask_database_url, FAST)
    runner = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 30)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner

    assert _live_loops() == []  # no claim loop, renewal or handler left behind
    row = await task_row(pgtask_async_engine, task_id)
    assert (row["state"], row["failed_attempts"]) == ("pending", 0)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == ["released"]


@pytest.fixture
def restricted_role(pgtask_engine: Engine, pgtask_database_url: str) -> Iterator[tuple[str, str]]:
    """A login role that may do a worker's job: (its name, a URL that logs in as it)."""
    role = f"worker_{uuid.uuid4().hex[:10]}"
    with pgtask_engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA pgtask TO {role}"))
        conn.execute(text(f"GRANT ALL ON ALL TABLES IN SCHEMA pgtask TO {role}"))
        conn.execute(text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA pgtask TO {role}"))
    url = make_url(pgtask_database_url).set(username=role, password=None)
    try:
        yield role, url.render_as_string(hide_password=False)
    finally:
        with pgtask_engine.begin() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE usename = :role"
                ),
                {"role": role},
            )
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


async def test_a_loop_that_fails_for_good_stops_the_worker_instead_of_leaving_a_zombie(
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    restricted_role: tuple[str, str],
) -> None:
    registry = Registry()
    release = asyncio.Event()

    @registry.task("job")
    async def job(ctx: TaskContext, payload: None) -> str:
        await release.wait()
        return "done"

    role, url = restricted_role
    task_id = await add(pgtask_async_engine, "job")
    worker = Worker(registry, url, FAST)
    runner = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.running_count == 1, 30, message="the handler to start")
    with pgtask_engine.begin() as conn:  # the worker's role loses a privilege it needs
        conn.execute(text(f"REVOKE UPDATE ON pgtask.attempts FROM {role}"))
    release.set()  # its outcome can now never be written

    with pytest.raises(WorkerCrashed, match="completer"):
        await asyncio.wait_for(runner, 30)
    assert _live_loops() == []
    # The worker did not keep its lease alive: the task is left for recovery.
    row = await task_row(pgtask_async_engine, task_id)
    assert row["state"] == "running"
    async with pgtask_async_engine.connect() as reader:
        alive = (
            await reader.execute(
                select(WorkerRecord.expires_at > text("pgtask.now()")).where(
                    WorkerRecord.id == worker.id
                )
            )
        ).scalar_one()
    assert alive is False


# -- B6: the idle-poll race and resumed queues -------------------------------------------------


def went_idle(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.getMessage().startswith("idle: next claim") for r in caplog.records)


async def test_a_due_task_the_claim_skipped_is_claimed_once_free_not_after_the_poll_interval(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="sqlalchemy_pgtask.worker")
    registry = Registry()

    @registry.task("due")
    async def due(ctx: TaskContext, payload: None) -> str:
        return "ran"

    task_id = await add(pgtask_async_engine, "due")
    slow_poll = WorkerOptions(lease_duration=1.5, poll_interval=600.0)
    with pgtask_engine.connect() as holder:
        # Someone holds the due task's row: the claim skips it (SKIP LOCKED), and it becomes
        # claimable without any notification the moment the holder lets go.
        holder.execute(
            text("SELECT 1 FROM pgtask.tasks WHERE id = :id FOR UPDATE"), {"id": task_id}
        )
        async with running_worker(registry, pgtask_database_url, slow_poll):
            await wait_until(lambda: went_idle(caplog), message="the worker to go idle")
            assert (await task_row(pgtask_async_engine, task_id))["state"] == "pending"
            holder.rollback()
            row = await wait_for_state(pgtask_async_engine, task_id, timeout=60)
    assert row["state"] == "succeeded"


async def test_resuming_a_paused_queue_wakes_idle_workers(
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="sqlalchemy_pgtask.worker")
    registry = Registry()

    @registry.task("held-back")
    async def held_back(ctx: TaskContext, payload: None) -> str:
        return "ran"

    with pgtask_engine.begin() as conn:
        configure_queue(conn, "default", paused=True)
    task_id = await add(pgtask_async_engine, "held-back")
    slow_poll = WorkerOptions(lease_duration=1.5, poll_interval=600.0)
    async with running_worker(registry, pgtask_database_url, slow_poll):
        await wait_until(lambda: went_idle(caplog), message="the worker to go idle")
        assert (await task_row(pgtask_async_engine, task_id))["state"] == "pending"
        with pgtask_engine.begin() as conn:
            configure_queue(conn, "default", paused=False)
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=60)
    assert row["state"] == "succeeded"


# -- B8: the LISTEN connection comes from the engine -----------------------------------------


@pytest.fixture
async def tagged_engine(pgtask_database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(
        pgtask_database_url, connect_args={"application_name": "tagged-by-connect-args"}
    )
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_the_listener_uses_the_engines_connect_args(
    tagged_engine: AsyncEngine, pgtask_engine: Engine
) -> None:
    registry = Registry()
    registry.task("noop")(lambda ctx, payload: None)
    async with running_worker(registry, tagged_engine, FAST):
        with pgtask_engine.connect() as conn:
            names = conn.execute(
                text(
                    "SELECT application_name FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query = 'LISTEN pgtask_ready'"
                )
            ).scalars().all()
    assert names == ["tagged-by-connect-args"]


# -- B16: worker rows are pruned -------------------------------------------------------------


async def test_rows_of_workers_gone_longer_than_the_retention_are_pruned(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    def insert_worker(expired_seconds_ago: int) -> uuid.UUID:
        worker_id = uuid.uuid4()
        with pgtask_engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO pgtask.workers (id, queues, version, hostname, pid,"
                    " concurrency, expires_at) VALUES (:id, '{default}', 'old', 'gone', 1, 1,"
                    " pgtask.now() - make_interval(secs => :ago))"
                ),
                {"id": worker_id, "ago": expired_seconds_ago},
            )
            conn.execute(
                text(
                    "INSERT INTO pgtask.worker_capabilities VALUES (:id, 'default', 'noop', 1)"
                ),
                {"id": worker_id},
            )
        return worker_id

    long_gone, recently_gone = insert_worker(7200), insert_worker(600)
    registry = Registry()
    registry.task("noop")(lambda ctx, payload: None)

    def remaining() -> set[uuid.UUID]:
        with pgtask_engine.connect() as conn:
            return set(conn.execute(select(WorkerRecord.id)).scalars())

    async with running_worker(registry, pgtask_database_url, FAST) as worker:
        await wait_until(lambda: long_gone not in remaining(), message="the old row to go")
        assert {recently_gone, worker.id} <= remaining()
    with pgtask_engine.connect() as conn:
        capabilities = conn.execute(
            text("SELECT count(*) FROM pgtask.worker_capabilities WHERE worker_id = :id"),
            {"id": long_gone},
        ).scalar_one()
    assert capabilities == 0


# -- review findings: a crash still writes what was decided; loops cancelled from outside -----


async def test_a_crash_of_another_loop_still_hands_running_tasks_back(
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
    restricted_role: tuple[str, str],
) -> None:
    registry = Registry()

    @registry.task("long")
    async def long(ctx: TaskContext, payload: None) -> None:
        await asyncio.sleep(3600)

    role, url = restricted_role
    task_id = await add(pgtask_async_engine, "long", max_attempts=1)
    options = WorkerOptions(
        lease_duration=5.0, heartbeat_interval=0.1, worker_ttl=30.0, shutdown_grace=0.0
    )
    worker = Worker(registry, url, options)
    runner = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.running_count == 1, 30, message="the handler to start")
    with pgtask_engine.begin() as conn:  # the heartbeat can no longer be written
        conn.execute(text(f"REVOKE UPDATE ON pgtask.workers FROM {role}"))

    with pytest.raises(WorkerCrashed, match="heartbeat"):
        await asyncio.wait_for(runner, 30)
    # The outcome writer was healthy: the running task was released, not left to expire
    # (which would fail this max_attempts=1 task without another run).
    row = await task_row(pgtask_async_engine, task_id)
    assert (row["state"], row["failed_attempts"]) == ("pending", 0)
    assert [a["state"] for a in await attempt_rows(pgtask_async_engine, task_id)] == ["released"]


async def test_a_loop_cancelled_from_outside_stops_the_worker(
    pgtask_database_url: str,
) -> None:
    registry = Registry()
    registry.task("noop")(lambda ctx, payload: None)
    worker = Worker(registry, pgtask_database_url, FAST)
    runner = asyncio.create_task(worker.run())
    await worker.wait_until_ready(30)
    [renewer] = [t for t in asyncio.all_tasks() if t.get_name() == "pgtask-renewer"]
    renewer.cancel()  # e.g. an application that cancels tasks it does not own
    with pytest.raises(WorkerCrashed, match="renewer loop was cancelled"):
        await asyncio.wait_for(runner, 30)
    assert _live_loops() == []
