"""Which event loop `sqlalchemy_pgtask.worker.run` (and ``pgtask worker --loop``) runs on.

``auto`` takes uvloop when it can be imported and asyncio's loop otherwise; ``uvloop``
without uvloop installed, or a name that is no loop, is refused before anything starts.
"""

from __future__ import annotations

import sys

import pytest

from sqlalchemy_pgtask import InvalidOptionError, Registry
from sqlalchemy_pgtask.worker import run
from sqlalchemy_pgtask.worker._main import resolve_event_loop


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
