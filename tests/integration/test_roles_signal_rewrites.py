"""A signal never changes, whoever holds the grant its emission needs.

``emit_signal`` writes ``ON CONFLICT DO UPDATE SET value = value`` to lock and return the
first value, which PostgreSQL allows only with ``UPDATE (value)`` on ``pgtask.signals``: so the
producer holds it (docs/roles.md). A trigger (revision ``pgtask_0011``) refuses any update
that would change a stored signal, so that grant cannot rewrite one a task has not read yet
(an approval turned into its opposite); the no-op update of a repeated emission still works.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from sqlalchemy_pgtask import enqueue
from sqlalchemy_pgtask.durable.signals import emit_signal
from tests.support.roles import login_roles, role_engine, sqlstate_of

#: SQLSTATE of a refused change of a stored signal.
SIGNAL_IMMUTABLE = "PT004"


def _stored(owner: Engine) -> object:
    with owner.connect() as connection:
        return connection.execute(text("SELECT value FROM pgtask.signals")).scalar_one()


def test_a_producer_cannot_rewrite_a_signal_it_may_emit_again(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job").id
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.producer) as producer,
    ):
        with producer.begin() as connection:
            assert emit_signal(connection, task_id, "approved", False) is False
        with pytest.raises(DBAPIError) as caught, producer.begin() as connection:
            connection.execute(text("UPDATE pgtask.signals SET value = 'true'"))
        assert sqlstate_of(caught.value) == SIGNAL_IMMUTABLE
        # Emitting again still returns the first value, through the same no-op update.
        with producer.begin() as connection:
            assert emit_signal(connection, task_id, "approved", True) is False
    assert _stored(pgtask_engine) is False


def test_nobody_changes_a_stored_signal_not_even_the_owner(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job").id
        emit_signal(owner, task_id, "go", {"n": 1})
    for change in (
        "UPDATE pgtask.signals SET value = '{\"n\": 2}'",
        "UPDATE pgtask.signals SET occurrence = occurrence + 1",
        "UPDATE pgtask.signals SET created_at = created_at - interval '1 day'",
    ):
        with pytest.raises(DBAPIError) as caught, pgtask_engine.begin() as connection:
            connection.execute(text(change))
        assert sqlstate_of(caught.value) == SIGNAL_IMMUTABLE, change
    assert _stored(pgtask_engine) == {"n": 1}
    # An update that changes nothing is no change.
    with pgtask_engine.begin() as connection:
        connection.execute(text("UPDATE pgtask.signals SET value = value"))
