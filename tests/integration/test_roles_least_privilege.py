"""What the levels' grants allowed beyond the library's own calls is refused (revisions
``pgtask_0014`` and ``pgtask_0015``), while the library's calls still work as each role.

Each attack logs in as the role and writes plain SQL the role's column grants let through:

* a producer extending, releasing or re-pointing an idempotency key (it holds UPDATE on the
  key columns to take over an expired reservation);
* a worker deleting a task that has not finished, or finished within its queue's retention
  (it holds DELETE on tasks for retention);
* a worker rewriting a checkpoint (it holds UPDATE (value) for the first-value-wins upsert);
* an administrator numbering or dating its own audit entry;
* a producer in a REPEATABLE READ transaction naming a queue in ``pgtask.checked_queues``,
  which ``pgtask.queues_current()`` trusted as already checked against a newer limit.

* a producer reserving a key by raw INSERT for no task or for another's task (it holds
  INSERT on the key columns for its own enqueues).
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from sqlalchemy_pgtask import cancel, configure_queue, enqueue
from sqlalchemy_pgtask._failures import is_serialization_failure
from tests.support.roles import DENIED, login_roles, role_engine, sqlstate_of

KEY_REFUSED = "PT007"
DELETE_REFUSED = "PT006"
CHECKPOINT_IMMUTABLE = "PT005"


def _refused(engine: Engine, statement: str, sqlstate: str, **params: object) -> None:
    with pytest.raises(DBAPIError) as caught, engine.begin() as connection:
        connection.execute(text(statement), params)
    assert sqlstate_of(caught.value) == sqlstate, f"{statement}: {caught.value!r}"


def _key(owner: Engine) -> tuple[uuid.UUID, object]:
    with owner.connect() as connection:
        row = connection.execute(
            text("SELECT task_id, expires_at FROM pgtask.idempotency_keys WHERE key = 'k'")
        ).one()
    return row.task_id, row.expires_at


def test_a_producer_cannot_extend_release_or_re_point_a_key(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        first = enqueue(owner, "job", idempotency_key="k").id
        other = enqueue(owner, "job").id
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.producer) as producer,
    ):
        # Release a live key, extend it, point it at another task or at no task.
        for statement in (
            "UPDATE pgtask.idempotency_keys SET expires_at = pgtask.now() - interval '1 s'",
            "UPDATE pgtask.idempotency_keys SET expires_at = 'infinity'",
            "UPDATE pgtask.idempotency_keys SET task_id = :other, created_at = pgtask.now()",
            "UPDATE pgtask.idempotency_keys SET task_id = gen_random_uuid(),"
            " created_at = pgtask.now()",
        ):
            _refused(producer, statement, KEY_REFUSED, other=other)
        assert _key(pgtask_engine) == (first, None)
        # Expired, a key still is not the producer's to point at no task: it would stay
        # reserved for ever.
        with pgtask_engine.begin() as owner:
            owner.execute(text(
                "UPDATE pgtask.idempotency_keys SET expires_at = pgtask.now() - interval '1 s'"
            ))
        _refused(
            producer,
            "UPDATE pgtask.idempotency_keys SET task_id = gen_random_uuid(),"
            " created_at = pgtask.now(), expires_at = NULL",
            KEY_REFUSED,
        )
        _refused(
            producer,
            "UPDATE pgtask.idempotency_keys SET task_id = :other, created_at = pgtask.now(),"
            " expires_at = NULL",
            KEY_REFUSED,
            other=other,
        )
        # The library's take-over of the expired key still works as the producer.
        with producer.begin() as connection:
            taken = enqueue(connection, "job", idempotency_key="k")
        assert taken.created
        assert taken.id not in (first, other)
        assert _key(pgtask_engine) == (taken.id, None)


def _finished_past_retention(owner: Connection, task_id: uuid.UUID) -> None:
    """Backdate a finished task past the default terminal retention (7 days): retention's
    to delete, so the worker and admin levels may."""
    owner.execute(
        text(
            "UPDATE pgtask.tasks SET completed_at = pgtask.now() - interval '8 days'"
            " WHERE id = :id"
        ),
        {"id": task_id},
    )


def test_a_worker_cannot_delete_a_task_that_has_not_finished(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        pending = enqueue(owner, "job").id
        done = enqueue(owner, "job").id
        assert cancel(owner, done) == "cancelled"
        _finished_past_retention(owner, done)
    with login_roles(pgtask_database_url) as roles:
        for role in (roles.worker, roles.admin):
            with role_engine(pgtask_database_url, role) as engine:
                _refused(
                    engine, "DELETE FROM pgtask.tasks WHERE id = :id", DELETE_REFUSED, id=pending
                )
        with (
            role_engine(pgtask_database_url, roles.worker) as worker,
            worker.begin() as connection,
        ):
            deleted = connection.execute(
                text("DELETE FROM pgtask.tasks WHERE id = :id"), {"id": done}
            ).rowcount
        assert deleted == 1
    with pgtask_engine.connect() as connection:
        left = connection.execute(text("SELECT id FROM pgtask.tasks")).scalars().all()
    assert left == [pending]


def test_nobody_changes_a_checkpoint_the_worker_least_of_all(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        task_id = enqueue(owner, "job").id
        owner.execute(
            text(
                "INSERT INTO pgtask.checkpoints (task_id, version, step, occurrence, kind, value)"
                " VALUES (:id, 1, 'charge', 0, 'step', '{\"paid\": false}')"
            ),
            {"id": task_id},
        )
    change = "UPDATE pgtask.checkpoints SET value = '{\"paid\": true}'"
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.worker) as worker,
    ):
        _refused(worker, change, CHECKPOINT_IMMUTABLE)
        # The first-value-wins upsert's no-op update still passes.
        with worker.begin() as connection:
            connection.execute(text("UPDATE pgtask.checkpoints SET value = value"))
    _refused(pgtask_engine, change, CHECKPOINT_IMMUTABLE)
    with pgtask_engine.connect() as connection:
        value = connection.execute(text("SELECT value FROM pgtask.checkpoints")).scalar_one()
    assert value == {"paid": False}


def test_an_admin_cannot_number_or_date_its_own_audit_entry(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.admin) as admin,
    ):
        _refused(
            admin,
            "INSERT INTO pgtask.audit_log (occurred_at, actor, action)"
            " VALUES ('2001-01-01', 'someone', 'task.cancel')",
            DENIED,
        )
        _refused(
            admin,
            "INSERT INTO pgtask.audit_log (id, actor, action) OVERRIDING SYSTEM VALUE"
            " VALUES (-1, 'someone', 'task.cancel')",
            DENIED,
        )
        with admin.begin() as connection:
            connection.execute(
                text("INSERT INTO pgtask.audit_log (actor, action) VALUES ('a', 'task.cancel')")
            )
    with pgtask_engine.connect() as connection:
        rows = connection.execute(
            text("SELECT id > 0 AND occurred_at > now() - interval '1 hour' FROM pgtask.audit_log")
        ).scalars().all()
    assert rows == [True]


def test_a_producer_cannot_skip_the_snapshot_check_of_a_queue_it_names_in_a_setting(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        enqueue(owner, "job", queue="limited")
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.producer) as producer,
    ):
        stale = producer.execution_options(isolation_level="REPEATABLE READ")
        with stale.connect() as connection:
            connection.execute(text("SELECT 1"))  # the snapshot, before the limit
            connection.execute(text("SET LOCAL pgtask.checked_queues = 'limited'"))
            with pgtask_engine.begin() as owner:
                configure_queue(owner, "limited", max_outstanding_tasks=1)
            with pytest.raises(DBAPIError) as caught:
                enqueue(connection, "job", queue="limited")
            assert is_serialization_failure(caught.value)
            connection.rollback()
    with pgtask_engine.connect() as connection:
        count = connection.execute(text("SELECT count(*) FROM pgtask.tasks")).scalar_one()
    assert count == 1


def test_the_record_of_checked_queues_is_not_the_producers_to_write_or_forge(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        enqueue(owner, "job", queue="limited")
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.producer) as producer,
    ):
        stale = producer.execution_options(isolation_level="REPEATABLE READ")
        with stale.connect() as connection:
            enqueue(connection, "job", queue="other")  # the owner's record now exists
            with pytest.raises(DBAPIError) as caught:
                connection.execute(
                    text("INSERT INTO pg_temp.pgtask_checked_queues VALUES ('limited')")
                )
            assert sqlstate_of(caught.value) == DENIED
            connection.rollback()
        with stale.connect() as connection:
            # A table of that name of the producer's own, made before the owner's.
            connection.execute(text("DISCARD TEMP"))
            connection.execute(text(
                "CREATE TEMPORARY TABLE pgtask_checked_queues (name text PRIMARY KEY)"
            ))
            connection.execute(text("INSERT INTO pgtask_checked_queues VALUES ('limited')"))
            with pgtask_engine.begin() as owner:
                configure_queue(owner, "limited", max_outstanding_tasks=1)
            with pytest.raises(DBAPIError) as caught:
                enqueue(connection, "job", queue="limited")
            assert is_serialization_failure(caught.value)
            connection.rollback()


def test_a_producer_cannot_reserve_a_key_for_no_task_or_for_another_task(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        other = enqueue(owner, "job").id
    with (
        login_roles(pgtask_database_url) as roles,
        role_engine(pgtask_database_url, roles.producer) as producer,
    ):
        # For no task: the key would stay reserved for ever (no task ever finishes to expire
        # it), and every enqueue with it would answer a task that does not exist.
        _refused(
            producer,
            "INSERT INTO pgtask.idempotency_keys (queue, key, task_id)"
            " VALUES ('default', 'orphan', gen_random_uuid())",
            KEY_REFUSED,
        )
        # For someone else's task: a later enqueue with the key would answer that task.
        _refused(
            producer,
            "INSERT INTO pgtask.idempotency_keys (queue, key, task_id)"
            " VALUES ('default', 'borrowed', :other)",
            KEY_REFUSED,
            other=other,
        )
        # The library's reservation still works as the producer.
        with producer.begin() as connection:
            assert enqueue(connection, "job", idempotency_key="mine").created
    with pgtask_engine.connect() as connection:
        reserved = connection.execute(
            text("SELECT key FROM pgtask.idempotency_keys ORDER BY key")
        ).scalars().all()
    assert reserved == ["mine"]


def test_retention_roles_cannot_delete_a_task_finished_within_its_retention(
    pgtask_database_url: str, pgtask_engine: Engine
) -> None:
    with pgtask_engine.begin() as owner:
        recent = enqueue(owner, "job").id
        assert cancel(owner, recent) == "cancelled"
        old = enqueue(owner, "job").id
        assert cancel(owner, old) == "cancelled"
        _finished_past_retention(owner, old)
    with login_roles(pgtask_database_url) as roles:
        for role in (roles.worker, roles.admin):
            with role_engine(pgtask_database_url, role) as engine:
                _refused(
                    engine, "DELETE FROM pgtask.tasks WHERE id = :id", DELETE_REFUSED, id=recent
                )
        with (
            role_engine(pgtask_database_url, roles.worker) as worker,
            worker.begin() as connection,
        ):
            # Past the default terminal retention (7 days): retention's to delete.
            deleted = connection.execute(
                text("DELETE FROM pgtask.tasks WHERE id = :id"), {"id": old}
            ).rowcount
        assert deleted == 1
