"""The outcome writer's batches: what it takes for its next write, decided without a database.

Only `_next_batch` runs here (it reads the writer's own queue and set-aside list); the writes
themselves are proven against PostgreSQL in ``tests/integration/test_outcome_writer_faults.py``.
"""

from __future__ import annotations

import time
from typing import Any, cast

from sqlalchemy_pgtask.outcome import Outcome
from sqlalchemy_pgtask.worker._completer import Completer, _Pending


def _writer(batch_size: int) -> Completer:
    # No write happens in these tests: the connection and the book are never touched.
    return Completer(
        connection=cast(Any, None), book=cast(Any, None), batch_size=batch_size,
        lease_seconds=30.0,
    )


def _item(**counts: int) -> _Pending:
    return _Pending(cast(Any, object()), Outcome("complete", "null"), **counts)


async def test_set_aside_outcomes_are_taken_at_most_a_batch_at_a_time() -> None:
    writer = _writer(batch_size=2)
    due = time.monotonic() - 1.0
    items = [_item(skipped=1) for _ in range(5)]
    writer._later = [(due + i * 0.01, item) for i, item in enumerate(items)]
    assert await writer._next_batch() == items[:2]  # the longest waiting first
    assert [item for _, item in writer._later] == items[2:]


async def test_an_outcome_cut_short_before_is_tried_alone() -> None:
    writer = _writer(batch_size=10)
    due = time.monotonic() - 1.0
    skipped, suspect = _item(skipped=1), _item(cut_short=1)
    writer._later = [(due, skipped), (due, suspect)]
    writer.submit(cast(Any, object()), Outcome("complete", "null"))
    assert await writer._next_batch() == [suspect]
    batch = await writer._next_batch()
    assert batch[0] is skipped
    assert len(batch) == 2  # the other set-aside one and the new one, together
