"""A batch that carries two requests for one task, a stale attempt's and the current one's,
writes the current attempt's values: each request is fenced by its own attempt and token.

The completer can hold both: an outcome set aside while its row was locked (its lease lapsing
meanwhile, renewals skipping the locked row too) meets the outcome of the task's next attempt,
claimed by the same worker, in one batch.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from sqlalchemy_pgtask import enqueue
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.outcome import error_document
from tests.support.tasks import claim_parameters, read_attempts, read_task

WORKER = uuid.UUID("00000000-0000-4000-8000-000000000002")


@pytest.fixture
def auto(pgtask_engine: Engine) -> Iterator[Connection]:
    with pgtask_engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        yield conn


def _lease(row: Any) -> st.Lease:
    return st.Lease(row.id, row.attempt, row.lease_token)


@pytest.fixture
def reclaimed(pgtask_engine: Engine, auto: Connection) -> tuple[st.Lease, st.Lease]:
    """Attempt 1 lost its lease and was recovered; attempt 2 holds the task now."""
    with pgtask_engine.begin() as conn:
        task_id = enqueue(conn, "job", {"n": 1}).id
    [first] = auto.execute(st.CLAIM, claim_parameters(worker_id=WORKER, lease=30.0)).all()
    auto.execute(
        text("UPDATE pgtask.tasks SET lease_expires_at = statement_timestamp() - interval '1 s'"
             " WHERE id = :id"),
        {"id": task_id},
    )
    assert auto.execute(st.RECOVER, {"limit": 10}).all() == [(task_id, "pending")]
    [second] = auto.execute(st.CLAIM, claim_parameters(worker_id=WORKER, lease=30.0)).all()
    return _lease(first), _lease(second)


@pytest.mark.parametrize("stale_first", [True, False])
def test_a_batch_with_a_stale_and_a_current_completion_of_one_task_stores_the_current_result(
    auto: Connection, reclaimed: tuple[st.Lease, st.Lease], stale_first: bool
) -> None:
    stale, current = reclaimed
    pairs = [(stale, "stale"), (current, "current")]
    if not stale_first:
        pairs.reverse()
    params = st.complete_params([p[0] for p in pairs], [json.dumps(p[1]) for p in pairs])
    assert auto.execute(st.COMPLETE, params).all() == [(current.task_id, "succeeded")]
    assert read_task(auto, current.task_id)["result"] == "current"
    assert [a["state"] for a in read_attempts(auto, current.task_id)] == ["lost", "succeeded"]


@pytest.mark.parametrize("stale_first", [True, False])
def test_a_batch_with_a_stale_and_a_current_failure_of_one_task_applies_the_current_one(
    auto: Connection, reclaimed: tuple[st.Lease, st.Lease], stale_first: bool
) -> None:
    stale, current = reclaimed
    # The stale attempt would fail for good; the current one asks for a retry.
    pairs: list[tuple[st.Lease, str, float | None]] = [
        (stale, error_document("fail", ValueError("stale")), None),
        (current, error_document("handler_error", ValueError("current")), 0.0),
    ]
    if not stale_first:
        pairs.reverse()
    params = st.fail_params([p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs])
    assert auto.execute(st.FAIL, params).all() == [(current.task_id, "pending")]
    row = read_task(auto, current.task_id)
    assert (row["state"], row["error"]["message"]) == ("pending", "current")
