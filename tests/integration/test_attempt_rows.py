"""Attempt rows outlive nothing: deleting or truncating tasks takes their attempts along.

Revision ``pgtask_0009`` dropped the foreign key from ``pgtask.attempts`` to ``pgtask.tasks``:
its row-by-row check locked every task a claim had just updated once more. Two statement-level
triggers keep what its ``ON DELETE CASCADE`` did, whoever deletes (retention's role included:
`tests/integration/test_roles.py`).
"""

from __future__ import annotations

import uuid

from sqlalchemy import Connection, Engine, text

from sqlalchemy_pgtask import enqueue
from tests.support.durable import claim, claim_one, complete


def _attempts(conn: Connection, *tasks: uuid.UUID) -> int:
    return int(conn.execute(
        text("SELECT count(*) FROM pgtask.attempts WHERE task_id = ANY(:ids)"), {"ids": list(tasks)}
    ).scalar_one())


def test_attempts_have_no_foreign_key_to_their_task(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as conn:
        keys = conn.execute(text(
            "SELECT conname FROM pg_constraint"
            " WHERE contype = 'f' AND conrelid = 'pgtask.attempts'::regclass"
        )).scalars().all()
    assert keys == []


def test_deleting_tasks_deletes_their_attempts_and_no_others(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        doomed = [enqueue(conn, "job").id for _ in range(3)]
        kept = enqueue(conn, "job").id
        leases = claim(conn, limit=4)
        assert len(leases) == 4
        for lease in leases:
            complete(conn, lease, "done")
        assert _attempts(conn, *doomed, kept) == 4
        deleted = conn.execute(
            text("DELETE FROM pgtask.tasks WHERE id = ANY(:ids)"), {"ids": doomed}
        ).rowcount
        assert deleted == 3
        assert _attempts(conn, *doomed) == 0
        assert _attempts(conn, kept) == 1


def test_a_rolled_back_delete_keeps_the_attempts(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        task = enqueue(conn, "job").id
        claim_one(conn)
    with pgtask_engine.connect() as conn:
        with conn.begin() as transaction:
            conn.execute(text("DELETE FROM pgtask.tasks WHERE id = :id"), {"id": task})
            assert _attempts(conn, task) == 0
            transaction.rollback()
        assert _attempts(conn, task) == 1


def test_truncating_tasks_empties_attempts(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(2):
            enqueue(conn, "job")
        assert len(claim(conn, limit=2)) == 2
        conn.execute(text("TRUNCATE pgtask.tasks CASCADE"))
        assert conn.execute(text("SELECT count(*) FROM pgtask.attempts")).scalar_one() == 0


def test_truncating_tasks_and_attempts_together_works(pgtask_engine: Engine) -> None:
    with pgtask_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        enqueue(conn, "job")
        claim_one(conn)
        conn.execute(text("TRUNCATE pgtask.tasks, pgtask.attempts CASCADE"))
        assert conn.execute(text("SELECT count(*) FROM pgtask.attempts")).scalar_one() == 0
