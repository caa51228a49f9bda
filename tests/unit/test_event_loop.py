"""Which event loop `sqlalchemy_pgtask.worker.run` (and ``pgtask worker --loop``) runs on,
and how it sets the cycle collector while the worker runs.

``auto`` takes uvloop when it can be imported and asyncio's loop otherwise; ``uvloop``
without uvloop installed, or a name that is no loop, is refused before anything starts.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from sqlalchemy_pgtask import InvalidOptionError, Registry
from sqlalchemy_pgtask.worker import run
from sqlalchemy_pgtask.worker._main import (
    COLLECTOR_THRESHOLD,
    collector_for_throughput,
    resolve_event_loop,
)


def test_asyncio_is_asyncio_whatever_is_installed() -> None:
    assert resolve_event_loop("asyncio") == "asyncio"


def test_auto_and_uvloop_take_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert resolve_event_loop("auto") == "uvloop"
    assert resolve_event_loop("uvloop") == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError

    assert resolve_event_loop("auto") == "asyncio"
    with pytest.raises(InvalidOptionError, match="uvloop is not installed") as refused:
        resolve_event_loop("uvloop")
    assert refused.value.field == "loop"


@pytest.mark.parametrize("name", ["trio", "", "UVLOOP"])
def test_a_name_that_is_no_loop_is_refused(name: str) -> None:
    with pytest.raises(InvalidOptionError, match="must be one of auto, asyncio, uvloop"):
        resolve_event_loop(name)


def test_run_refuses_a_bad_loop_before_it_connects_to_anything() -> None:
    registry = Registry()
    registry.task("t")(lambda ctx, payload: None)
    # Nothing listens there: a run that started would fail to connect instead.
    with pytest.raises(InvalidOptionError, match="loop"):
        run(registry, "postgresql+psycopg://nobody@127.0.0.1:9/nowhere", loop="trio")  # type: ignore[arg-type]


# -- the cycle collector while a worker runs -------------------------------------------------


@pytest.fixture
def collector() -> Iterator[None]:
    """Leaves the process's collector as it found it, whatever a test did."""
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()


def test_the_collector_runs_less_often_while_a_worker_runs_and_as_before_after(
    collector: None,
) -> None:
    gc.set_threshold(700, 10, 10)
    assert gc.get_freeze_count() == 0
    with collector_for_throughput():
        assert gc.get_threshold() == (COLLECTOR_THRESHOLD, 10, 10)
        assert gc.get_freeze_count() > 0  # what existed on entry is out of its collections
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


def _frozen(obj: object) -> bool:
    # The permanent generation is outside gc.get_objects(). Its size is no test: frozen
    # objects that die leave it, so the count drifts while the test runs.
    return not any(tracked is obj for tracked in gc.get_objects())


def test_a_higher_threshold_and_the_processs_own_freeze_are_kept(collector: None) -> None:
    gc.set_threshold(COLLECTOR_THRESHOLD * 2, 5, 5)
    kept: list[object] = [[]]
    gc.freeze()
    assert _frozen(kept)
    with collector_for_throughput():
        assert gc.get_threshold() == (COLLECTOR_THRESHOLD * 2, 5, 5)
    assert gc.get_threshold() == (COLLECTOR_THRESHOLD * 2, 5, 5)
    assert _frozen(kept)  # not unfrozen behind the process's back


def test_cyclic_garbage_still_goes_after_enough_allocations(collector: None) -> None:
    class Node:
        other: object = None

    with collector_for_throughput():
        gc.collect()  # the allocation counts start from zero
        first, second = Node(), Node()
        first.other, second.other = second, first
        gone = weakref.ref(first)
        del first, second
        kept: list[list[object]] = [[] for _ in range(COLLECTOR_THRESHOLD // 10)]
        assert gone() is not None  # not after a few thousand allocations, as at 700
        kept += [[] for _ in range(COLLECTOR_THRESHOLD * 2)]
        assert gone() is None
