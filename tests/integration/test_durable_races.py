"""Races of the durable transitions: many independent pairs, each side on its own connection.

Each race sets up `PAIRS` independent pairs (a waiter and the event it waits for), then runs
the two sides of every pair on two connections of their own: `LANES` lanes run at once, each
lane races its pairs one after the other, and a barrier releases both sides of a pair
together. Every race runs three times: with the first side favoured, with the second side
favoured (the side not favoured first makes `HEAD_START` round trips to the server), and
lined up; the test then asserts that both orders really happened. Nothing sleeps: the barrier
lines the sides up, and a side whose row is locked retries as the worker does (COMPLETE skips
a locked row instead of waiting for it).

After the races every pair is checked: no task is left ``waiting`` once its event committed,
the wait's step has exactly one checkpoint, and it holds the value of whichever committed
first. A deadlock (or any other database error) on either side fails the test with the error.

The statements are the compiled ones of ``sqlalchemy_pgtask.statements``, run with the
parameters the worker binds and in the worker's transactions (``tests.support.durable``).
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import pytest
from sqlalchemy import Connection, Engine

from tests.support import durable as d
from tests.support.waiting import PATIENCE

#: Independent pairs per race and bias.
PAIRS: Final = 40
#: Pairs raced at the same time (each lane holds two connections).
LANES: Final = 4
#: Round trips the side that is not favoured makes after the barrier, before its own work.
HEAD_START: Final = 4

Bias = Literal["first", "second", "even"]
BIASES: Final[tuple[Bias, ...]] = ("first", "second", "even")

_P = TypeVar("_P")
_A = TypeVar("_A")
_B = TypeVar("_B")


# -- the race harness ------------------------------------------------------------------------


def race(
    engine: Engine,
    pairs: Sequence[_P],
    first: Callable[[Connection, _P], _A],
    second: Callable[[Connection, _P], _B],
    *,
    bias: Bias,
    prepare: Callable[[Connection, _P], None] | None = None,
) -> list[tuple[_A, _B]]:
    """Race ``first(conn, pair)`` against ``second(conn, pair)`` for every pair.

    Each side has its own connection per lane (a plain one: the side commits what it does);
    ``prepare`` runs (and commits) on the first side's connection before the pair's barrier.
    The side not favoured by ``bias`` first makes `HEAD_START` round trips. The first exception
    of either side (a deadlock, say) stops every lane and is raised here.
    """
    firsts: dict[int, _A] = {}
    seconds: dict[int, _B] = {}
    errors: list[BaseException] = []
    barriers = [threading.Barrier(2, timeout=PATIENCE) for _ in range(LANES)]

    def lag(conn: Connection, favoured: bool) -> None:
        if bias == "even" or favoured:
            return
        for _ in range(HEAD_START):
            conn.exec_driver_sql("SELECT 1")
        conn.rollback()

    def run(lane: int, side: int) -> None:
        try:
            with engine.connect() as conn:
                for index in range(lane, len(pairs), LANES):
                    if errors:
                        return
                    pair = pairs[index]
                    if side == 0 and prepare is not None:
                        prepare(conn, pair)
                        conn.commit()
                    barriers[lane].wait()
                    if side == 0:
                        lag(conn, bias == "first")
                        firsts[index] = first(conn, pair)
                    else:
                        lag(conn, bias == "second")
                        seconds[index] = second(conn, pair)
        except threading.BrokenBarrierError:
            pass  # another side failed: its error is the one reported
        except BaseException as exc:
            errors.append(exc)
            for barrier in barriers:
                barrier.abort()

    threads = [
        threading.Thread(target=run, args=(lane, side), daemon=True)
        for lane in range(LANES)
        for side in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    assert not any(thread.is_alive() for thread in threads), "a racing side hangs"
    if errors:
        raise errors[0]
    assert len(firsts) == len(seconds) == len(pairs)
    return [(firsts[i], seconds[i]) for i in range(len(pairs))]


def both_orders(orders: Counter[str], *names: str) -> None:
    """Both orders happened at least once over the three biases: the race was real."""
    assert all(orders[name] > 0 for name in names), orders


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    """An autocommit connection for setting up and reading: every statement commits alone."""
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


@dataclass(frozen=True)
class Family:
    """A running parent and its running child, spawned at the parent's step ``spawn``."""

    parent: d.Lease
    child: d.Lease


def families(conn: Connection, count: int, tag: str) -> list[Family]:
    """``count`` running parents, each with one running child of its own; ``tag`` names this
    round's tasks, so that no other round's claim takes them."""
    for _ in range(count):
        d.add_task(conn, f"parent-{tag}")
    parents = d.claim(conn, f"parent-{tag}", limit=count)
    children = {d.spawn_child(conn, lease, "spawn", f"child-{tag}"): lease for lease in parents}
    claimed = {lease.task_id: lease for lease in d.claim(conn, f"child-{tag}", limit=count)}
    assert claimed.keys() == children.keys()
    return [Family(parent, claimed[child]) for child, parent in children.items()]


def child_result(family: Family) -> dict[str, Any]:
    return {"child": str(family.child.task_id)}


def finish_child(conn: Connection, family: Family) -> str:
    """The child's worker completes it, retrying while another transaction holds its row."""
    state, _ = d.complete_until_written(conn, family.child, child_result(family))
    return state


# -- signal emitted vs wait registered -------------------------------------------------------


def test_a_signal_and_its_wait_racing_never_leave_the_waiter_waiting(
    pgtask_engine: Engine, auto: Connection
) -> None:
    """Each pair: a running task registers a wait for signal ``go`` (LOCK_FOR_WAIT then
    REGISTER_SIGNAL_WAIT, one transaction) while another connection emits ``go`` (EMIT_SIGNAL,
    one transaction). Either the wait committed first and the signal's trigger woke the task
    (pending), or the signal committed first and the registration returned it at once without
    suspending (running, same lease). Both: one checkpoint ``{"signal": value}``, no wait."""
    orders: Counter[str] = Counter()
    for bias in BIASES:
        for _ in range(PAIRS):
            d.add_task(auto, f"job-{bias}")
        leases = d.claim(auto, f"job-{bias}", limit=PAIRS)

        def wait(conn: Connection, lease: d.Lease) -> tuple[bool, Any]:
            row = d.register_signal_wait(conn, lease, "approval", "go")
            conn.commit()
            assert row is not None
            assert row.held
            return bool(row.waiting), row.value

        def signal(conn: Connection, lease: d.Lease) -> Any:
            stored = d.emit(conn, lease.task_id, "go", {"for": str(lease.task_id)})
            conn.commit()
            return stored

        outcomes = race(pgtask_engine, leases, wait, signal, bias=bias)

        for lease, ((suspended, returned), emitted) in zip(leases, outcomes, strict=True):
            value = {"for": str(lease.task_id)}
            assert emitted == value
            task = d.task_of(auto, lease.task_id)
            assert d.signals_of(auto, lease.task_id) == {("go", 0): value}
            assert d.wait_of(auto, lease.task_id) is None
            assert d.checkpoints_of(auto, lease.task_id) == {
                ("approval", 0): ("signal", {"signal": value})
            }
            assert (task["attempt"], task["failed_attempts"]) == (1, 0)
            if suspended:
                orders["wait first"] += 1
                assert returned is None
                assert (task["state"], task["lease_token"]) == ("pending", None)
            else:
                orders["signal first"] += 1
                assert returned == {"signal": value}
                assert (task["state"], task["lease_token"]) == ("running", lease.token)
    both_orders(orders, "wait first", "signal first")


def test_a_signal_and_the_timeout_of_its_wait_racing_agree(
    pgtask_engine: Engine, auto: Connection
) -> None:
    """Each pair: a task waits for signal ``go`` with a timeout that just fell due; a timeout
    pass (WAIT_TIMEOUTS) races the signal (EMIT_SIGNAL). Whichever commits first is the
    checkpoint (``{"timeout": true}`` or ``{"signal": value}``); the task is pending either way,
    its wait is gone, and the signal is stored either way (a late one is only kept)."""
    orders: Counter[str] = Counter()
    for bias in BIASES:
        for _ in range(PAIRS):
            d.add_task(auto, f"job-{bias}")
        leases = d.claim(auto, f"job-{bias}", limit=PAIRS)
        for lease in leases:
            d.waiting_on_signal(auto, lease, "approval", "go", timeout=3600.0)

        def due(conn: Connection, lease: d.Lease) -> None:
            d.make_wait_due(conn, lease.task_id)

        def time_out(conn: Connection, lease: d.Lease) -> list[uuid.UUID]:
            woken = d.wait_timeouts(conn)
            conn.commit()
            return woken

        def signal(conn: Connection, lease: d.Lease) -> Any:
            stored = d.emit(conn, lease.task_id, "go", {"for": str(lease.task_id)})
            conn.commit()
            return stored

        outcomes = race(pgtask_engine, leases, time_out, signal, bias=bias, prepare=due)

        woken_by_a_pass = {task_id for woken, _ in outcomes for task_id in woken}
        for lease in leases:
            value = {"for": str(lease.task_id)}
            task = d.task_of(auto, lease.task_id)
            assert (task["state"], task["failed_attempts"]) == ("pending", 0)
            assert d.wait_of(auto, lease.task_id) is None
            assert d.signals_of(auto, lease.task_id) == {("go", 0): value}
            [(kind, stored)] = d.checkpoints_of(auto, lease.task_id).values()
            assert kind == "signal"
            if stored == {"timeout": True}:
                orders["timeout first"] += 1
                assert lease.task_id in woken_by_a_pass
            else:
                orders["signal first"] += 1
                assert stored == {"signal": value}
                assert lease.task_id not in woken_by_a_pass
        assert d.wait_timeouts(auto) == []
    both_orders(orders, "timeout first", "signal first")


# -- child completion vs result wait registered ----------------------------------------------


def test_a_child_completion_and_the_result_wait_racing_never_leave_the_parent_waiting(
    pgtask_engine: Engine, auto: Connection
) -> None:
    """Each pair: a running parent registers a wait for its running child's result
    (LOCK_FOR_WAIT, LOCK_CHILD, REGISTER_RESULT_WAIT, one transaction) while the child's worker
    completes it (COMPLETE, retried while the registration holds the child's row). Either the
    wait committed first and the child's completion woke the parent (pending), or the child
    finished first and the registration returned its outcome at once (running, same lease).
    Both: one checkpoint with the child's real outcome, no wait."""
    orders: Counter[str] = Counter()
    for bias in BIASES:
        pairs = families(auto, PAIRS, bias)

        def wait(conn: Connection, family: Family) -> tuple[bool, Any]:
            row = d.register_result_wait(
                conn, family.parent, "await-child", family.child.task_id
            )
            conn.commit()
            assert row is not None
            assert row.held
            return bool(row.waiting), row.value

        outcomes = race(pgtask_engine, pairs, wait, finish_child, bias=bias)

        for family, ((suspended, returned), written) in zip(pairs, outcomes, strict=True):
            parent_id, child_id = family.parent.task_id, family.child.task_id
            outcome = {"state": "succeeded", "result": child_result(family), "error": None}
            assert written == "succeeded"
            child = d.task_of(auto, child_id)
            assert (child["state"], child["cancel_requested_at"]) == ("succeeded", None)
            parent = d.task_of(auto, parent_id)
            assert d.wait_of(auto, parent_id) is None
            assert d.checkpoints_of(auto, parent_id) == {
                ("spawn", 0): ("spawn", {"task_id": str(child_id)}),
                ("await-child", 0): ("result", outcome),
            }
            assert parent["failed_attempts"] == 0
            if suspended:
                orders["wait first"] += 1
                assert returned is None
                assert (parent["state"], parent["lease_token"]) == ("pending", None)
            else:
                orders["child first"] += 1
                assert returned == outcome
                assert (parent["state"], parent["lease_token"]) == (
                    "running", family.parent.token,
                )
    both_orders(orders, "wait first", "child first")


# -- parent timeout vs child completion ------------------------------------------------------


TIMED_OUT: Final = {"state": "timeout", "result": None, "error": None}


def waiting_families(conn: Connection, count: int, tag: str) -> list[Family]:
    """Families whose parent waits for its running child's result, with an hour's timeout."""
    pairs = families(conn, count, tag)
    for family in pairs:
        d.waiting_on_child(
            conn, family.parent, "await-child", family.child.task_id, timeout=3600.0
        )
    return pairs


def make_due(conn: Connection, family: Family) -> None:
    d.make_wait_due(conn, family.parent.task_id)


def time_out(conn: Connection, family: Family) -> list[uuid.UUID]:
    woken = d.wait_timeouts(conn)
    conn.commit()
    return woken


def test_a_result_wait_timeout_and_the_child_completion_racing_agree(
    pgtask_engine: Engine, auto: Connection
) -> None:
    """Each pair: a parent waits for its running child with a timeout that just fell due; a
    timeout pass (WAIT_TIMEOUTS) races the child's COMPLETE. The invariant asserted:

    * Child first: its completion woke the parent in its own transaction with the child's real
      outcome; the pass then found no waiting parent (or skipped it while the completion held
      it) and wrote nothing for it. The child succeeded and nobody asked it to cancel.
    * Timeout first: the pass found the child unfinished (a finished child would already have
      resolved the wait), stored the timeout as the parent's checkpoint, woke the parent and
      requested the running child's cancellation. The child's COMPLETE (skipped while the pass
      held its row) then records ``cancelled``, never a success nobody will read.

    Either way the parent is pending with no wait and exactly one checkpoint for the step, and
    a later pass finds nothing to do.
    """
    orders: Counter[str] = Counter()
    for bias in BIASES:
        pairs = waiting_families(auto, PAIRS, bias)
        outcomes = race(
            pgtask_engine, pairs, time_out, finish_child, bias=bias, prepare=make_due
        )

        woken_by_a_pass = {task_id for woken, _ in outcomes for task_id in woken}
        for family, (_, written) in zip(pairs, outcomes, strict=True):
            parent_id, child_id = family.parent.task_id, family.child.task_id
            parent = d.task_of(auto, parent_id)
            child = d.task_of(auto, child_id)
            assert (parent["state"], parent["failed_attempts"]) == ("pending", 0)
            assert d.wait_of(auto, parent_id) is None
            checkpoints = d.checkpoints_of(auto, parent_id)
            assert checkpoints.keys() == {("spawn", 0), ("await-child", 0)}
            kind, value = checkpoints["await-child", 0]
            assert kind == "result"
            assert child["state"] == written
            if value == TIMED_OUT:
                orders["timeout first"] += 1
                assert parent_id in woken_by_a_pass
                assert child["state"] == "cancelled"
                assert child["cancel_requested_at"] is not None
                assert (child["result"], child["error"]) == (None, {"type": "cancelled"})
            else:
                orders["child first"] += 1
                assert parent_id not in woken_by_a_pass
                assert value == {
                    "state": "succeeded", "result": child_result(family), "error": None,
                }
                assert (child["state"], child["cancel_requested_at"]) == ("succeeded", None)
                assert child["result"] == child_result(family)
        assert d.wait_timeouts(auto) == []
    both_orders(orders, "timeout first", "child first")


# -- opposite lock orders: a child ends (child, then parent) while its parent ends (parent,
# then children). Racing found deadlocks here (3-8 per 100 pairs) until the child's side
# stopped waiting for the parent (NOWAIT): now it fails at once and writes again.

#: Pairs per bias: enough to have hit a deadlock every time before the fix.
DEADLOCK_PAIRS: Final = 120


def test_cancelling_waiting_parents_racing_their_children_completions_never_deadlocks(
    pgtask_engine: Engine, auto: Connection
) -> None:
    """Each pair: a parent waits (no timeout) for its running child; an operator cancels the
    parent (``cancel()``, one transaction) while the child's worker completes the child."""
    for bias in BIASES:
        pairs = families(auto, DEADLOCK_PAIRS, bias)
        for family in pairs:
            d.waiting_on_child(auto, family.parent, "await-child", family.child.task_id)

        def cancel(conn: Connection, family: Family) -> str | None:
            state = d.cancel_task(conn, family.parent.task_id)
            conn.commit()
            return state

        outcomes = race(pgtask_engine, pairs, cancel, finish_child, bias=bias)
        for family, (cancelled, written) in zip(pairs, outcomes, strict=True):
            assert cancelled == "cancelled"
            assert d.task_of(auto, family.parent.task_id)["state"] == "cancelled"
            assert d.task_of(auto, family.child.task_id)["state"] == written


def test_a_result_wait_timeout_racing_a_grandchild_completion_never_deadlocks(
    pgtask_engine: Engine, auto: Connection
) -> None:
    """Parent timeout vs completion one level down: each parent waits (timeout due) for its
    child, which itself waits for its own running grandchild; the timeout pass (which cancels
    the child and, by cascade, asks the grandchild to cancel) races the grandchild's COMPLETE
    (whose trigger wakes the child)."""
    for bias in BIASES:
        pairs = families(auto, DEADLOCK_PAIRS, bias)
        grandchildren = {
            d.spawn_child(auto, f.child, "spawn", f"grandchild-{bias}"): f for f in pairs
        }
        claimed = d.claim(auto, f"grandchild-{bias}", limit=DEADLOCK_PAIRS)
        triples: list[tuple[Family, d.Lease]] = []
        for lease in claimed:
            family = grandchildren[lease.task_id]
            d.waiting_on_child(auto, family.child, "await-grandchild", lease.task_id)
            d.waiting_on_child(
                auto, family.parent, "await-child", family.child.task_id, timeout=3600.0
            )
            triples.append((family, lease))

        def due(conn: Connection, triple: tuple[Family, d.Lease]) -> None:
            d.make_wait_due(conn, triple[0].parent.task_id)

        def timeout(conn: Connection, triple: tuple[Family, d.Lease]) -> list[uuid.UUID]:
            woken = d.wait_timeouts(conn)
            conn.commit()
            return woken

        def finish(conn: Connection, triple: tuple[Family, d.Lease]) -> str:
            state, _ = d.complete_until_written(conn, triple[1], "done")
            return state

        race(pgtask_engine, triples, timeout, finish, bias=bias, prepare=due)
        # A pass that found a child held by its grandchild's completion left that parent for
        # a later pass: this one, with nothing held any more.
        d.wait_timeouts(auto)
        for family, _ in triples:
            assert d.task_of(auto, family.parent.task_id)["state"] == "pending"
            assert d.wait_of(auto, family.child.task_id) is None
