"""Prometheus metrics and health probes, scraped over HTTP the way Prometheus and Kubernetes do.

The ``pgtask worker`` subprocess tests run the command as an operator would; the probe tests
that need a fault (a LISTEN that cannot be set up, a database the backlog sampler cannot
reach) run a worker in-process behind `tests.support.faultproxy`. Every wait polls with a
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    InvalidOptionError,
    Registry,
    SyncTaskContext,
    TaskContext,
    Worker,
    WorkerOptions,
    cancel_async,
)
from sqlalchemy_pgtask.testing import running_worker
from sqlalchemy_pgtask.testing import wait_until as wait_until_async
from tests.support.faultproxy import FaultProxy, fault_proxy
from tests.support.tasks import add, wait_for_state
from tests.support.waiting import PATIENCE, wait_event, wait_until
from tests.support.workerproc import (
    Database,
    WorkerLauncher,
    WorkerProcess,
    describe_all,
    terminate_backends,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(port: int, path: str) -> tuple[int, str] | None:
    """Status and body of ``GET path``; None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return int(error.code), error.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None


def samples(body: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def value(body: str, metric: str, /, **labels: str) -> float | None:
    """The sample ``metric`` with exactly ``labels``, or None if the scrape has none."""
    return samples(body).get((metric, frozenset(labels.items())))


def scrape(port: int) -> str:
    answer = get(port, "/metrics")
    assert answer is not None, "nothing listens on the metrics port"
    assert answer[0] == 200, answer
    return answer[1]


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (from /proc: its sockets in LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def start_with_metrics(workers: WorkerLauncher, *options: str) -> tuple[WorkerProcess, int]:
    port = free_port()
    worker = workers.start(
        "--metrics-port", str(port), "--metrics-interval", "0.2", *options
    )
    wait_until(lambda: get(port, "/healthz"), PATIENCE, message="the metrics server",
               describe=worker.describe)
    return worker, port


def test_a_worker_without_a_metrics_port_listens_on_no_port(workers: WorkerLauncher) -> None:
    worker = workers.start()
    assert listening_ports(worker.pid) == set()


def test_the_metrics_count_what_the_worker_did(workers: WorkerLauncher, db: Database) -> None:
    succeeded = db.enqueue("job", {"sleep": 0.8}, count=3)  # long enough to be renewed
    [failing] = db.enqueue("job", {"fail": True}, max_attempts=3)
    db.enqueue("job", count=2, version=2)  # no worker serves version 2: they wait
    worker, port = start_with_metrics(workers)
    assert listening_ports(worker.pid) == {port}

    def finished() -> str:
        body = scrape(port)
        done = value(body, "pgtask_tasks_succeeded_total", queue="default", name="job") == 3
        failed = value(
            body, "pgtask_tasks_failed_total",
            queue="default", name="job", error_kind="handler_error",
        )
        return body if done and failed == 1 else ""

    body = wait_until(finished, PATIENCE, message="the counters", describe=worker.describe)
    assert db.state(failing) == "failed"
    assert db.all_in(succeeded, "succeeded")
    job = {"queue": "default", "name": "job"}
    assert value(body, "pgtask_tasks_started_total", **job) == 6
    assert value(body, "pgtask_tasks_retried_total", **job, error_kind="handler_error") == 2
    assert value(
        body, "pgtask_attempt_duration_seconds_count", **job, outcome="succeeded"
    ) == 3
    assert value(body, "pgtask_attempt_duration_seconds_count", **job, outcome="failed") == 1
    assert (value(body, "pgtask_claim_batch_size_count") or 0) >= 1
    assert (value(body, "pgtask_claim_batch_size_sum") or 0) == 6
    assert (value(body, "pgtask_lease_renewals_total") or 0) >= 1
    assert value(body, "pgtask_worker_slots") == 10
    assert value(body, "pgtask_worker_running_slots") == 0

    def backlog() -> bool:
        body = scrape(port)
        age = value(body, "pgtask_queue_oldest_pending_age_seconds", queue="default")
        return value(body, "pgtask_queue_depth", queue="default") == 2 and (age or 0) > 0

    wait_until(backlog, PATIENCE, message="the sampled backlog", describe=worker.describe)
    assert get(port, "/healthz") == (200, "ok\n")
    assert get(port, "/readyz") == (200, "ready\n")
    answer = get(port, "/nowhere")
    assert answer is not None
    assert answer[0] == 404

    # Every connection of the worker is cut: each comes back, and says so.
    assert terminate_backends(db) >= 1
    wait_until(
        lambda: (value(scrape(port), "pgtask_reconnects_total") or 0) >= 1, PATIENCE,
        message="a reconnect counted", describe=worker.describe,
    )


def test_readiness_goes_while_the_worker_drains_and_the_port_closes_at_exit(
    workers: WorkerLauncher, db: Database
) -> None:
    [task] = db.enqueue("job", {"until": "go"})
    worker, port = start_with_metrics(workers)
    wait_until(lambda: db.state(task) == "running", PATIENCE, message="the task to start",
               describe=worker.describe)
    assert get(port, "/readyz") == (200, "ready\n")
    worker.send(signal.SIGTERM)
    wait_until(lambda: get(port, "/readyz") == (503, "draining\n"), PATIENCE,
               message="readyz to say draining", describe=describe_all([worker]))
    assert get(port, "/healthz") == (200, "stopping\n")  # alive: not to be killed mid-drain
    workers.release("go")
    assert worker.wait_exit(PATIENCE) == 0
    assert db.state(task) == "succeeded"
    assert get(port, "/healthz") is None


def test_a_metrics_port_without_prometheus_client_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(InvalidOptionError, match=r"prometheus-client.*\[metrics\]"):
        WorkerOptions(metrics_port=9100)
    WorkerOptions()  # without a port nothing needs it


# -- in-process, behind a fault proxy -------------------------------------------------------


def through(database_url: str, port: int) -> str:
    url = make_url(database_url).set(host="127.0.0.1", port=port)
    return url.update_query_dict({"sslmode": "disable"}).render_as_string(hide_password=False)


def heal(proxy: FaultProxy) -> None:
    """Let every connection through again (the proxy drops nothing from now on)."""
    proxy._rules.clear()


async def probe(port: int, path: str) -> tuple[int, str] | None:
    return await asyncio.to_thread(get, port, path)


def registry() -> Registry:
    tasks = Registry()

    @tasks.task("noop")
    async def noop(ctx: TaskContext, payload: None) -> None:
        return None

    return tasks


async def test_readiness_waits_for_listen_and_registration(pgtask_database_url: str) -> None:
    url = make_url(pgtask_database_url)
    port = free_port()
    options = WorkerOptions(metrics_port=port, metrics_interval=0.2, lease_duration=3.0)
    async with fault_proxy(str(url.host or "127.0.0.1"), url.port or 5432) as proxy:
        proxy.drop_before(b"LISTEN pgtask_ready", times=1_000_000)  # no LISTEN, no registration
        worker = Worker(registry(), through(pgtask_database_url, proxy.port), options)
        runner = asyncio.create_task(worker.run())
        try:
            await proxy.wait_dropped(2)  # the listener tried, and tries again
            assert await probe(port, "/readyz") == (503, "not registered yet\n")
            assert await probe(port, "/healthz") == (200, "starting\n")
            heal(proxy)
            await worker.wait_until_ready(PATIENCE)
            await wait_until_async(lambda: _ready(port), PATIENCE, message="readyz 200")
        finally:
            worker.shutdown()
            await runner


async def _ready(port: int) -> bool:
    return await probe(port, "/readyz") == (200, "ready\n")


async def test_readiness_goes_while_the_database_cannot_be_reached(
    pgtask_database_url: str,
) -> None:
    url = make_url(pgtask_database_url)
    port = free_port()
    options = WorkerOptions(metrics_port=port, metrics_interval=0.1, lease_duration=3.0)
    async with fault_proxy(str(url.host or "127.0.0.1"), url.port or 5432) as proxy:
        # Every backlog sample loses its connection before the server sees it.
        proxy.drop_before(b") AS depth", times=1_000_000)
        worker = Worker(registry(), through(pgtask_database_url, proxy.port), options)
        runner = asyncio.create_task(worker.run())
        try:
            await worker.wait_until_ready(PATIENCE)
            await proxy.wait_dropped(1)
            await wait_until_async(
                lambda: _answer(port, (503, "database unreachable\n")), PATIENCE,
                message="readyz 503",
            )
            assert await probe(port, "/healthz") == (200, "ok\n")
            heal(proxy)
            await wait_until_async(lambda: _ready(port), PATIENCE, message="readyz 200")
        finally:
            worker.shutdown()
            await runner


async def _answer(port: int, expected: tuple[int, str]) -> bool:
    return await probe(port, "/readyz") == expected


async def test_a_metrics_port_in_use_stops_the_worker_at_startup_with_the_address(
    pgtask_database_url: str,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        worker = Worker(registry(), pgtask_database_url, WorkerOptions(metrics_port=port))
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            await worker.run()


async def test_a_success_after_a_cancel_request_is_counted_as_cancelled(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    # COMPLETE stores such a task as cancelled; the metrics counted it as succeeded.
    tasks = Registry()
    started = threading.Event()

    @tasks.task("ignores")
    def ignores(ctx: SyncTaskContext, payload: None) -> str:
        started.set()
        # It notices the request (the renewal brings it) and returns a result all the same.
        wait_until(lambda: ctx.cancelled, PATIENCE, message="the cancel request")
        return "done anyway"

    port = free_port()
    options = WorkerOptions(metrics_port=port, lease_duration=0.6)
    task_id = await add(pgtask_async_engine, "ignores")
    async with running_worker(tasks, pgtask_database_url, options):
        await wait_event(started)
        async with pgtask_async_engine.begin() as conn:
            await cancel_async(conn, task_id)  # running: its worker learns at its next renewal
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        body = await asyncio.to_thread(scrape, port)
    assert row["state"] == "cancelled"
    labels = {"queue": "default", "name": "ignores"}
    assert value(body, "pgtask_tasks_succeeded_total", **labels) in (None, 0.0)
    assert value(body, "pgtask_attempt_duration_seconds_count", outcome="cancelled",
                 **labels) == 1.0
