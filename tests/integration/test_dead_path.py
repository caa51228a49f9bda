"""A path to PostgreSQL that goes silent (issue 23, items 3 and 5): an intermediary keeps the
worker's connections open, acks every byte, and forwards nothing (`tests.support.blackhole`).

Every statement the worker sends has a deadline on its own clock: a connection that answers
nothing is severed and replaced, so once the path comes back the worker claims again, and its
heartbeat goes on, without a restart. Meanwhile the probes say so: ``/healthz`` fails once no
round trip succeeded for ``health_timeout``, ``/readyz`` while the worker cannot claim, and
``pgtask status`` shows a worker whose heartbeat stopped as such.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import Registry, TaskContext, WorkerOptions
from sqlalchemy_pgtask.cli._render import status_lines
from sqlalchemy_pgtask.status import live_workers
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.acceptance.test_metrics import free_port, probe
from tests.support.blackhole import black_hole_proxy
from tests.support.tasks import add, wait_for_state
from tests.support.waiting import PATIENCE

#: Polling often makes the claim loop send statements into the hole (a worker that sent
#: nothing there would come back by luck).
OPTIONS = WorkerOptions(lease_duration=1.5, poll_interval=0.2, heartbeat_interval=0.3,
                        worker_ttl=30.0, shutdown_grace=1.0)


def _registry() -> Registry:
    registry = Registry()

    @registry.task("echo")
    async def echo(ctx: TaskContext, payload: int) -> int:
        return payload

    return registry


async def _heartbeat(engine: AsyncEngine, worker_id: uuid.UUID) -> object:
    async with engine.connect() as conn:
        return (
            await conn.execute(
                text("SELECT heartbeat_at FROM pgtask.workers WHERE id = :id"), {"id": worker_id}
            )
        ).scalar_one()


async def test_a_worker_behind_a_path_that_went_silent_claims_again_once_it_is_back(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    with black_hole_proxy(pgtask_database_url) as proxy:
        async with running_worker(_registry(), proxy.url(pgtask_database_url), OPTIONS) as worker:
            before = await add(pgtask_async_engine, "echo", 1)
            await wait_for_state(pgtask_async_engine, before, timeout=PATIENCE)
            proxy.black_hole()
            accepted = proxy.accepted
            # In the hole: statements go out and nothing comes back; the worker must notice
            # (it replaces its connections: new ones are opened through the proxy).
            await wait_until(lambda: proxy.accepted > accepted + 2, PATIENCE,
                             message="the worker opened new connections")
            during = await add(pgtask_async_engine, "echo", 2)
            beat = await _heartbeat(pgtask_async_engine, worker.id)
            proxy.resume()
            row = await wait_for_state(pgtask_async_engine, during, timeout=PATIENCE)
            assert (row["state"], row["result"]) == ("succeeded", 2)

            async def beating() -> bool:
                return await _heartbeat(pgtask_async_engine, worker.id) != beat

            await wait_until(beating, PATIENCE, message="the heartbeat resumed")


async def test_the_probes_fail_while_the_path_is_silent_and_recover_when_it_is_back(
    pgtask_database_url: str,
) -> None:
    port = free_port()
    options = WorkerOptions(lease_duration=1.5, poll_interval=0.2, heartbeat_interval=0.3,
                            worker_ttl=30.0, shutdown_grace=1.0, metrics_port=port,
                            health_timeout=3.0)
    with black_hole_proxy(pgtask_database_url) as proxy:
        async with running_worker(_registry(), proxy.url(pgtask_database_url), options):
            assert await probe(port, "/healthz") == (200, "ok\n")
            await wait_until(lambda: _answers(port, "/readyz", 200), PATIENCE)
            proxy.black_hole()
            await wait_until(lambda: _answers(port, "/healthz", 503), PATIENCE,
                             message="healthz 503 once no round trip for 3 s")
            _, body = await probe(port, "/healthz") or (0, "")
            assert body.startswith("no round trip to PostgreSQL for "), body
            assert (await probe(port, "/readyz") or (0, ""))[0] == 503
            proxy.resume()
            await wait_until(lambda: _answers(port, "/healthz", 200), PATIENCE)
            await wait_until(lambda: _answers(port, "/readyz", 200), PATIENCE)


async def _answers(port: int, path: str, status: int) -> bool:
    answer = await probe(port, path)
    return answer is not None and answer[0] == status


async def test_status_shows_a_worker_whose_heartbeat_stopped_as_such(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    options = WorkerOptions(lease_duration=1.5, poll_interval=0.2, heartbeat_interval=0.3,
                            worker_ttl=20.0, shutdown_grace=1.0)

    def status() -> str:
        with pgtask_engine.connect() as conn:
            return "\n".join(status_lines(live_workers(conn), [], []))

    with black_hole_proxy(pgtask_database_url) as proxy:
        async with running_worker(_registry(), proxy.url(pgtask_database_url), options) as worker:
            await wait_until(lambda: str(worker.id) in status(), PATIENCE)
            assert "heartbeat stopped" not in status()
            proxy.black_hole()
            await wait_until(lambda: "heartbeat stopped" in status(), PATIENCE,
                             message="status says the heartbeat stopped")
            [line] = [x for x in status().splitlines() if str(worker.id) in x]
            assert "s ago (expires in " in line, line
