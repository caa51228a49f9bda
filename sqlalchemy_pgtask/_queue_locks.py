"""_queue_locks: the locks `configure_queue` takes before it changes a queue's row, in order.

Turning a capacity limit on recounts the queue's outstanding tasks under ``LOCK TABLE
pgtask.tasks`` (the trigger ``queue_capacity_changed`` does it), which waits for every
transaction that wrote to the table. A producer of a limited queue writes its task first and
then locks the queue row (``pgtask.admit``). So whoever holds the queue row while waiting for
the table lock can deadlock with a producer that has written its task and waits for that row:
a producer whose snapshot still showed the limit (it waited behind the turn-off that had just
committed), or one under REPEATABLE READ, which locks even an unlimited queue's row. Here the
table is locked first, then the row; the trigger's own lock is then already held.

Changing a limit that is already on recounts nothing and takes no table lock (it would hold
back every writer of ``pgtask.tasks`` until commit for nothing). When such a limit was turned
off after the unlocked look and before the row lock, the row lock is undone (a savepoint) and
taken again after the table lock.
"""

from __future__ import annotations

import typing
from typing import Any, Final

from sqlalchemy import Connection, RowMapping, Select, Table, select, text

from sqlalchemy_pgtask.models import Queue

__all__ = ["locked_queue_row"]

#: The recount's table lock, bounded like the trigger's (while it waits in the lock queue,
#: every writer of pgtask.tasks waits too), with the trigger's error: 55P03, "waited 3 s".
#: A DO block: its EXCEPTION clause runs the lock in a subtransaction, whose lock is kept.
_LOCK_TASKS: Final = text("""
DO $$
DECLARE
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '3s', true);
    LOCK TABLE pgtask.tasks IN SHARE ROW EXCLUSIVE MODE;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
EXCEPTION WHEN lock_not_available THEN
    RAISE EXCEPTION 'turning on the capacity of a queue waited 3 s for transactions'
        ' writing to pgtask.tasks'
        USING ERRCODE = '55P03',
              HINT = 'A transaction that enqueued or changed tasks is still open;'
                     ' retry when it has ended.';
END
$$
""")


def _limit_now(connection: Connection, name: str) -> tuple[bool, Any]:
    """Whether the queue row exists, and its limit, as the latest commit left them (unlocked)."""
    queues = typing.cast(Table, Queue.__table__)
    row = connection.execute(
        select(queues.c.max_outstanding_tasks).where(queues.c.name == name)
    ).first()
    return (row is not None, None if row is None else row[0])


def locked_queue_row(
    connection: Connection, name: str, locked: Select[Any], sets_limit: bool
) -> RowMapping | None:
    """The queue row ``locked`` selects, locked; the tasks table first when a limit turns on.

    ``sets_limit``: the change sets a (non-null) ``max_outstanding_tasks``. Returns None when
    the queue has no row (the caller creates it, under the table lock when ``sets_limit``).
    """
    if not sets_limit:
        return connection.execute(locked).mappings().first()
    exists, limit = _limit_now(connection, name)
    if exists and limit is not None:
        savepoint = connection.begin_nested()
        before = connection.execute(locked).mappings().first()
        if before is not None and before["max_outstanding_tasks"] is not None:
            savepoint.commit()
            return before
        # Turned off (or deleted) since the look: let go of the row, the table comes first.
        savepoint.rollback()
    connection.execute(_LOCK_TASKS)
    return connection.execute(locked).mappings().first()
