"""Result waiters share one listening connection per engine, and outlive it.

``wait_for_result`` and ``wait_for_result_async`` each used to hold a connection of the engine's
pool (LISTENing) for as long as they waited: more concurrent waiters than the pool holds timed
out on the pool. Now every waiter of an engine shares one listening connection, which is
closed when the last one leaves and reopened when it breaks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Collection, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    Task,
    enqueue_many,
    wait_for_result,
    wait_for_result_async,
)
from sqlalchemy_pgtask.testing import wait_until as wait_until_async
from tests.support.urls import libpq_url
from tests.support.waiting import PATIENCE, SLOW_POLL, wait_until

WAITERS = 12
#: A pool far smaller than the waiters: each waiter needs a connection only to read.
POOL = {"pool_size": 2, "max_overflow": 0, "pool_timeout": PATIENCE}


def frames(exc: BaseException, function: str) -> int:
    """How many frames of ``function`` the traceback of ``exc`` passes through."""
    return sum(1 for frame, _ in traceback.walk_tb(exc.__traceback__)
               if frame.f_code.co_name == function)


def add_tasks(url: str, count: int) -> list[uuid.UUID]:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            results = enqueue_many(conn, [EnqueueRequest(name="job") for _ in range(count)])
        return [r.id for r in results]
    finally:
        engine.dispose()


def finish(url: str, ids: list[uuid.UUID]) -> None:
    """Mark the tasks succeeded (the terminal trigger sends their notifications)."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(
            "UPDATE pgtask.tasks SET state = 'succeeded', result = '\"done\"',"
            " completed_at = statement_timestamp() WHERE id = ANY(%s)",
            (ids,),
        )


def listeners(url: str) -> list[int]:
    """Backend pids LISTENing on the result channel in this test's database."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND query = 'LISTEN pgtask_result'"
        ).fetchall()
    return [row[0] for row in rows]


def reconnected(url: str, before: list[int]) -> bool:
    """One listener again, and not the one before."""
    now = listeners(url)
    return len(now) == 1 and now != before


def terminate(url: str, pids: list[int]) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))


class Reads:
    """Counts the waiters' reads of the tasks table on ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        self._lock = threading.Lock()
        event.listen(engine, "after_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "pgtask.tasks" in statement:
            with self._lock:
                self.count += 1


@pytest.fixture
def small_pool_engine(pgtask_database_url: str) -> Iterator[Engine]:
    engine = create_engine(pgtask_database_url, **POOL)
    yield engine
    engine.dispose()


def wait_in_threads(
    engine: Engine, ids: list[uuid.UUID]
) -> tuple[list[threading.Thread], dict[uuid.UUID, Any]]:
    outcome: dict[uuid.UUID, Any] = {}

    def wait(task_id: uuid.UUID) -> None:
        try:
            outcome[task_id] = wait_for_result(
                engine, task_id, timeout=2 * PATIENCE, poll_interval=SLOW_POLL
            )
        except BaseException as exc:  # reported by the assertions below
            outcome[task_id] = exc

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in ids]
    for thread in threads:
        thread.start()
    return threads, outcome


def assert_all_succeeded(outcome: dict[uuid.UUID, Any], ids: list[uuid.UUID]) -> None:
    assert set(outcome) == set(ids)
    errors = [o for o in outcome.values() if not isinstance(o, Task)]
    assert not errors, errors[:3]
    assert {o.state for o in outcome.values()} == {"succeeded"}


def test_more_sync_waiters_than_the_pool_share_one_listener_and_are_woken(
    pgtask_database_url: str, small_pool_engine: Engine
) -> None:
    ids = add_tasks(pgtask_database_url, WAITERS)
    reads = Reads(small_pool_engine)
    threads, outcome = wait_in_threads(small_pool_engine, ids)
    # Every waiter read its task (pending) and waits now; their poll is far beyond PATIENCE.
    wait_until(lambda: reads.count >= WAITERS, PATIENCE, message="every waiter's first read")
    assert len(listeners(pgtask_database_url)) == 1
    assert not outcome
    finish(pgtask_database_url, ids)
    for thread in threads:
        thread.join(PATIENCE)
    assert_all_succeeded(outcome, ids)
    # The last waiter to leave closes the shared connection.
    wait_until(lambda: not listeners(pgtask_database_url), PATIENCE, message="no listener")


def test_sync_waiters_outlive_their_listening_connection(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    ids = add_tasks(pgtask_database_url, 3)
    reads = Reads(pgtask_engine)
    threads, outcome = wait_in_threads(pgtask_engine, ids)
    wait_until(lambda: reads.count >= 3, PATIENCE, message="every waiter's first read")
    first = listeners(pgtask_database_url)
    assert len(first) == 1
    terminate(pgtask_database_url, first)
    wait_until(lambda: reconnected(pgtask_database_url, first), PATIENCE, message="a new listener")
    finish(pgtask_database_url, ids)
    for thread in threads:
        thread.join(PATIENCE)
    assert_all_succeeded(outcome, ids)


async def no_listener_left(url: str) -> None:
    async def none() -> bool:  # a closed connection's backend may take a moment to exit
        return not await asyncio.to_thread(listeners, url)

    await wait_until_async(none, PATIENCE, message="no listener left")


async def read_count_reaches(reads: Reads, count: int) -> None:
    await wait_until_async(lambda: reads.count >= count, PATIENCE, message=f"{count} reads")


async def test_more_async_waiters_than_the_pool_share_one_listener_and_are_woken(
    pgtask_database_url: str,
) -> None:
    engine: AsyncEngine = create_async_engine(pgtask_database_url, **POOL)
    try:
        ids = await asyncio.to_thread(add_tasks, pgtask_database_url, WAITERS)
        reads = Reads(engine.sync_engine)
        waiters = [
            asyncio.create_task(
                wait_for_result_async(engine, i, timeout=2 * PATIENCE, poll_interval=SLOW_POLL)
            )
            for i in ids
        ]
        await read_count_reaches(reads, WAITERS)
        assert len(await asyncio.to_thread(listeners, pgtask_database_url)) == 1
        assert not any(w.done() for w in waiters)
        await asyncio.to_thread(finish, pgtask_database_url, ids)
        tasks = await asyncio.wait_for(asyncio.gather(*waiters), PATIENCE)
        assert {t.state for t in tasks} == {"succeeded"}
        assert [t.id for t in tasks] == ids
        await no_listener_left(pgtask_database_url)
    finally:
        await engine.dispose()


async def test_async_waiters_outlive_their_listening_connection(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sqlalchemy_pgtask.results")
    ids = await asyncio.to_thread(add_tasks, pgtask_database_url, 3)
    reads = Reads(pgtask_async_engine.sync_engine)
    waiters = [
        asyncio.create_task(
            wait_for_result_async(
                pgtask_async_engine, i, timeout=2 * PATIENCE, poll_interval=SLOW_POLL
            )
        )
        for i in ids
    ]
    await read_count_reaches(reads, 3)
    first = await asyncio.to_thread(listeners, pgtask_database_url)
    assert len(first) == 1
    await asyncio.to_thread(terminate, pgtask_database_url, first)

    async def new_listener() -> bool:
        return await asyncio.to_thread(reconnected, pgtask_database_url, first)

    await wait_until_async(new_listener, PATIENCE, message="a new listener")
    await asyncio.to_thread(finish, pgtask_database_url, ids)
    tasks = await asyncio.wait_for(asyncio.gather(*waiters), PATIENCE)
    assert {t.state for t in tasks} == {"succeeded"}
    assert any("reconnecting" in r.getMessage() for r in caplog.records)


async def test_a_listener_that_cannot_connect_fails_its_waiters_and_the_next_ones_try_again(
    pgtask_database_url: str,
) -> None:
    engine = create_async_engine(pgtask_database_url.rsplit("/", 1)[0] + "/no_such_database")
    try:
        for _ in range(2):
            waiters = [
                asyncio.create_task(wait_for_result_async(engine, uuid.uuid4(), timeout=PATIENCE))
                for _ in range(3)
            ]
            done = await asyncio.wait_for(
                asyncio.gather(*waiters, return_exceptions=True), PATIENCE
            )
            assert all(isinstance(d, Exception) for d in done), done
            assert all("no_such_database" in str(d) for d in done), done
            # Each waiter raises its own copy of the one failure: raising one object in
            # three waiters spliced the three waiters' frames into one traceback.
            assert len({id(d) for d in done}) == 3
            assert len({type(d) for d in done}) == 1
            assert [frames(d, "subscribed") for d in done if isinstance(d, BaseException)] == [
                1, 1, 1
            ]
    finally:
        await engine.dispose()
    sync = create_engine(pgtask_database_url.rsplit("/", 1)[0] + "/no_such_database")
    try:
        for _ in range(2):
            with pytest.raises(Exception, match="no_such_database"):
                await asyncio.to_thread(wait_for_result, sync, uuid.uuid4(), timeout=PATIENCE)
    finally:
        sync.dispose()


async def test_two_waiters_of_one_task_are_both_woken(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    [task_id] = await asyncio.to_thread(add_tasks, pgtask_database_url, 1)
    reads = Reads(pgtask_async_engine.sync_engine)
    both = [
        asyncio.create_task(
            wait_for_result_async(
                pgtask_async_engine, task_id, timeout=2 * PATIENCE, poll_interval=SLOW_POLL
            )
        )
        for _ in range(2)
    ]
    await read_count_reaches(reads, 2)
    await asyncio.to_thread(finish, pgtask_database_url, [task_id])
    first, second = await asyncio.wait_for(asyncio.gather(*both), PATIENCE)
    assert first.id == second.id == task_id
    assert first.state == second.state == "succeeded"


async def test_a_cancelled_waiter_leaves_the_others_listening_and_the_last_closes_it(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    ids = await asyncio.to_thread(add_tasks, pgtask_database_url, 2)
    reads = Reads(pgtask_async_engine.sync_engine)
    gone, kept = (
        asyncio.create_task(
            wait_for_result_async(
                pgtask_async_engine, task_id, timeout=2 * PATIENCE, poll_interval=SLOW_POLL
            )
        )
        for task_id in ids
    )
    await read_count_reaches(reads, 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(await asyncio.to_thread(listeners, pgtask_database_url)) == 1
    await asyncio.to_thread(finish, pgtask_database_url, ids)
    assert (await asyncio.wait_for(kept, PATIENCE)).state == "succeeded"
    await no_listener_left(pgtask_database_url)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_waiter_waits_listens_for_itself(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    parent_task, child_task = add_tasks(pgtask_database_url, 2)
    reads = Reads(pgtask_engine)
    threads, outcome = wait_in_threads(pgtask_engine, [parent_task])
    # The parent's waiter has read and given its connection back: only the listener's is out.
    pool: Any = pgtask_engine.pool
    wait_until(
        lambda: reads.count >= 1 and pool.checkedout() == 1,
        PATIENCE, message="the parent's waiter waiting",
    )
    pid = os.fork()
    if pid == 0:  # the child reports through its exit status only, never back into pytest
        code = 1
        try:
            pgtask_engine.dispose(close=False)  # the parent's pooled connections stay its own
            child_reads = Reads(pgtask_engine)

            def finish_once_read() -> None:
                wait_until(lambda: child_reads.count >= 1, PATIENCE, message="the child's read")
                finish(pgtask_database_url, [child_task])

            threading.Thread(target=finish_once_read, daemon=True).start()
            # Its poll and timeout are far beyond the parent's deadline: only a notification
            # to a listener of its own ends the wait in time.
            task = wait_for_result(
                pgtask_engine, child_task, timeout=4 * PATIENCE, poll_interval=SLOW_POLL
            )
            code = 0 if task.state == "succeeded" else 2
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    assert exit_code_within(pid, PATIENCE) == 0
    finish(pgtask_database_url, [parent_task])
    for thread in threads:
        thread.join(PATIENCE)
    assert_all_succeeded(outcome, [parent_task])


def exit_code_within(pid: int, seconds: float) -> int:
    """The forked child's exit code; killed (and the test failed) if it runs past ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child did not end within {seconds:.0f} s")
        time.sleep(0.05)  # polling a child's exit status, not synchronisation


def listener_threads(besides: Collection[threading.Thread] = ()) -> int:
    """The result listeners' threads alive, except `besides` (an earlier test's, still ending)."""
    return sum(
        1
        for t in threading.enumerate()
        if t.name == "pgtask-result-listener" and t not in besides
    )


def test_sync_waiters_one_after_another_reuse_the_listener_its_last_waiter_left(
    pgtask_database_url: str,
) -> None:
    # The listener's thread notices its last waiter left only between two reads: the next
    # waiter used to start another listener (and connection) beside it, every time, until
    # the pool ran out (then each waited for the previous listener to let its connection go).
    ids = add_tasks(pgtask_database_url, 10)
    finish(pgtask_database_url, ids)
    engine = create_engine(pgtask_database_url)
    # A test before this one in the same process may have left a listener thread that is
    # still ending (one whose server went away, say): only this engine's count here.
    earlier = set(threading.enumerate())
    try:
        alive, checked_out = [], []
        for task_id in ids:
            assert wait_for_result(engine, task_id, timeout=PATIENCE).state == "succeeded"
            alive.append(listener_threads(besides=earlier))
            checked_out.append(engine.pool.checkedout())  # type: ignore[attr-defined]
        assert max(alive) == 1
        assert max(checked_out) == 1  # the listener's, left for the next waiter
        # Without waiters, the listener closes its connection.
        wait_until(
            lambda: listener_threads(besides=earlier) == 0,
            PATIENCE,
            message="the listener to close",
        )
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        engine.dispose()


@pytest.fixture
def unanswering_server() -> Iterator[str]:
    """The address of a server that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # the kernel completes the handshakes; nobody reads
        yield f"127.0.0.1:{server.getsockname()[1]}"
    # Closing it resets the connections left waiting: their listener fails and goes.


def test_a_sync_waiter_keeps_its_timeout_while_the_listener_cannot_connect(
    unanswering_server: str,
) -> None:
    engine = create_engine(f"postgresql+psycopg://nobody@{unanswering_server}/nothing")
    outcomes: list[BaseException] = []

    def wait() -> None:
        try:
            wait_for_result(engine, uuid.uuid4(), timeout=0.2)
        except BaseException as exc:  # whatever it raised is the finding
            outcomes.append(exc)

    try:
        # The second waiter joins the first's listener, still connecting: it used to block
        # with it, for as long as the connection did.
        waiters = [threading.Thread(target=wait) for _ in range(2)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join(PATIENCE)
        assert not any(waiter.is_alive() for waiter in waiters), "a waiter ignored its timeout"
        assert [type(exc) for exc in outcomes] == [TimeoutError, TimeoutError]
        assert all("did not finish within 0.2 s" in str(exc) for exc in outcomes)
    finally:
        engine.dispose()


async def test_an_async_waiter_keeps_its_own_timeout_while_the_listener_connects(
    unanswering_server: str,
) -> None:
    engine = create_async_engine(f"postgresql+psycopg://nobody@{unanswering_server}/nothing")
    try:
        # The listener's connection is bounded by its first waiter's poll interval (30 s);
        # both waiters used to wait that long, and fail with its message.
        first = asyncio.create_task(
            wait_for_result_async(engine, uuid.uuid4(), timeout=0.2, poll_interval=30)
        )
        second = asyncio.create_task(wait_for_result_async(engine, uuid.uuid4(), timeout=0.3))
        done = await asyncio.wait_for(
            asyncio.gather(first, second, return_exceptions=True), PATIENCE
        )
        assert [type(d) for d in done] == [TimeoutError, TimeoutError]
        assert "did not finish within 0.2 s" in str(done[0])
        assert "did not finish within 0.3 s" in str(done[1])
    finally:
        await engine.dispose()


def test_a_sync_waiter_whose_read_finds_the_pool_exhausted_past_its_deadline_times_out(
    pgtask_database_url: str,
) -> None:
    # Two pooled connections: the listener takes one, the test holds the other. The read
    # waited for the pool's own checkout timeout and raised SQLAlchemy's pool TimeoutError,
    # which is not the TimeoutError the waiter documents.
    engine = create_engine(pgtask_database_url, pool_size=2, max_overflow=0, pool_timeout=1)
    [task_id] = add_tasks(pgtask_database_url, 1)
    try:
        with engine.connect(), pytest.raises(TimeoutError, match=r"did not finish within 0\.2 s"):
            wait_for_result(engine, task_id, timeout=0.2)
    finally:
        engine.dispose()


async def test_an_async_waiter_whose_read_finds_the_pool_exhausted_past_its_deadline_times_out(
    pgtask_database_url: str,
) -> None:
    engine = create_async_engine(pgtask_database_url, pool_size=2, max_overflow=0, pool_timeout=1)
    [task_id] = add_tasks(pgtask_database_url, 1)
    try:
        async with engine.connect():
            with pytest.raises(TimeoutError, match=r"did not finish within 0\.2 s"):
                await wait_for_result_async(engine, task_id, timeout=0.2)
    finally:
        await engine.dispose()
