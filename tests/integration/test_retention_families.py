"""Retention keeps a family until it can go as a whole, then deletes it leaves first.

A family is a root and all its descendants. While any member is unfinished or within its own
queue's terminal retention, every member stays: a kept failed or cancelled member can be
retried, and its replay waits for its children's results again. A finished child in a
short-retention queue used to go as soon as its parent was past the parent's own retention,
although the parent was kept (by another child in a long-retention queue) and could still be
retried: the replayed ``wait_for_result`` then found no child.

Old history is made by inserting terminal rows directly, then moving the database clock.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, text

from sqlalchemy_pgtask import configure_queue
from sqlalchemy_pgtask.retention import run_retention
from sqlalchemy_pgtask.testing import DatabaseClock
from tests.integration.test_retention import DAY, finished, tasks_left

YEAR = 365 * DAY


def _left(engine: Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT id FROM pgtask.tasks")).scalars())


def _short_and_long(engine: Engine) -> None:
    with engine.begin() as conn:
        configure_queue(conn, "short", terminal_retention_seconds=0)
        configure_queue(conn, "long", terminal_retention_seconds=int(YEAR))


def test_a_short_lived_child_stays_while_a_sibling_keeps_its_parent(
    pgtask_engine: Engine, pgtask_clock: DatabaseClock
) -> None:
    _short_and_long(pgtask_engine)
    with pgtask_engine.begin() as conn:
        # The parent is past its own retention, but kept by its long-lived child: it can be
        # retried, and its replay waits for both children again.
        (parent,) = finished(conn, age=DAY, queue="short", state="failed")
        (brief,) = finished(conn, age=DAY, queue="short", parent=parent)
        (lasting,) = finished(conn, age=DAY, queue="long", parent=parent)
    assert run_retention(pgtask_engine).tasks_deleted == 0
    assert _left(pgtask_engine) == {parent, brief, lasting}
    pgtask_clock.advance(YEAR)  # the whole family is past its retention: it goes, leaves first
    result = run_retention(pgtask_engine)
    assert (result.tasks_deleted, tasks_left(pgtask_engine)) == (3, 0)


def test_a_grandchild_stays_while_its_root_is_kept(pgtask_engine: Engine) -> None:
    _short_and_long(pgtask_engine)
    with pgtask_engine.begin() as conn:
        (root,) = finished(conn, age=DAY, queue="long", state="failed")
        # The middle task is past its retention but kept (its root is): it can be retried.
        (middle,) = finished(conn, age=DAY, queue="short", parent=root, state="failed")
        (leaf,) = finished(conn, age=DAY, queue="short", parent=middle)
    assert run_retention(pgtask_engine).tasks_deleted == 0
    assert _left(pgtask_engine) == {root, middle, leaf}


def test_an_unfinished_member_keeps_its_whole_family(pgtask_engine: Engine) -> None:
    with pgtask_engine.begin() as conn:
        (root,) = finished(conn, age=30 * DAY)
        (done,) = finished(conn, age=30 * DAY, parent=root)
        (open_branch,) = finished(conn, age=30 * DAY, parent=root)
        running = conn.execute(text(
            "INSERT INTO pgtask.tasks (queue, name, payload, parent_id)"
            " VALUES ('default', 'job', 'null', :p) RETURNING id"), {"p": open_branch},
        ).scalar_one()
        (stranger,) = finished(conn, age=30 * DAY)  # another family, all past retention
    assert run_retention(pgtask_engine).tasks_deleted == 1
    assert _left(pgtask_engine) == {root, done, open_branch, running}
    assert stranger not in _left(pgtask_engine)
