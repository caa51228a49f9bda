"""statements.retention: deleting expired history in bounded batches; no I/O.

Three independent deletions, each a short statement that skips rows others hold:

* `DELETE_FINISHED_TASKS`: workflow families (a root and all its descendants) whose every
  member is a terminal task older than its queue's terminal retention, each whole in one
  statement;
* `DELETE_EXPIRED_KEYS`: idempotency reservations whose expiry was written down (their task
  was deleted) and has passed;
* `DELETE_FINISHED_KEYS`: reservations whose task still exists but finished longer ago than
  the queue's idempotency retention (a retention shorter than the task history's).

They lock finished tasks and reservations only, with ``SKIP LOCKED``, so retention never
waits for a claim and never holds one up, however slow or stuck it is. (The one exception is
momentary: a task an administrator retried after the statement's snapshot is locked before
its state is re-checked, and PostgreSQL keeps that lock until the statement's transaction
ends, a batch's few milliseconds; a claim skips it meanwhile, as it skips any row held.)
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    CTE,
    ColumnElement,
    FromClause,
    Integer,
    Select,
    Text,
    bindparam,
    cast,
    func,
    literal_column,
    or_,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.dml import ReturningDelete
from sqlalchemy.sql.elements import TextClause

from sqlalchemy_pgtask.statements._common import (
    NOW,
    TSTZ,
    UUID_T,
    arrays,
    keys,
    queues,
    seconds,
    tasks,
)
from sqlalchemy_pgtask.statements._family import (
    DEFAULT_TERMINAL_RETENTION_SECONDS,
    FREE_FAMILY,
    families,
    key_free,
    returning_delete,
)
from sqlalchemy_pgtask.statements.enqueue import DEFAULT_IDEMPOTENCY_RETENTION_SECONDS
from sqlalchemy_pgtask.states import TERMINAL_STATES

__all__ = [
    "DEFAULT_IDEMPOTENCY_RETENTION_SECONDS",
    "DEFAULT_TERMINAL_RETENTION_SECONDS",
    "DELETE_EXPIRED_KEYS",
    "DELETE_FINISHED_KEYS",
    "DELETE_FINISHED_TASK",
    "DELETE_FINISHED_TASKS",
    "FINISHED_QUEUES",
    "FINISHED_TASK_CANDIDATES",
]


def _finished(table: FromClause = tasks) -> ColumnElement[bool]:
    # Literals, so the planner matches the partial index ix_tasks_finished in a generic plan.
    return table.c.state.in_([literal_column(f"'{state}'") for state in TERMINAL_STATES])


def _queue_filter(column: ColumnElement[Any]) -> ColumnElement[bool]:
    """``column`` is the bound ``queue``, or every queue when it is NULL."""
    wanted = bindparam("queue", type_=Text)
    return or_(wanted.is_(None), column == wanted)


def _finished_queues() -> CTE:
    """The queues that have terminal tasks, by a loose index scan of ``ix_tasks_finished``.

    One ``min(queue)`` probe per distinct queue (each an index descent past the previous
    queue) instead of a scan of every terminal row.
    """
    inner = tasks.alias("f")
    first = select(func.min(inner.c.queue).label("queue")).where(_finished(inner))
    walk = first.cte("finished_queues", recursive=True)
    after = tasks.alias("g")
    following = (
        select(func.min(after.c.queue))
        .where(_finished(after), after.c.queue > walk.c.queue)
        .scalar_subquery()
    )
    return walk.union_all(select(following).where(walk.c.queue.is_not(None)))


def _policies() -> CTE:
    """Each queue with terminal tasks and its two retentions (the defaults without a row)."""
    walk = _finished_queues()
    return (
        select(
            walk.c.queue,
            func.coalesce(
                queues.c.terminal_retention_seconds, DEFAULT_TERMINAL_RETENTION_SECONDS
            ).label("terminal_retention"),
            func.coalesce(
                queues.c.idempotency_retention_seconds, DEFAULT_IDEMPOTENCY_RETENTION_SECONDS
            ).label("idempotency_retention"),
        )
        .select_from(walk.outerjoin(queues, queues.c.name == walk.c.queue))
        .where(walk.c.queue.is_not(None), _queue_filter(walk.c.queue))
        .cte("policies")
    )


def _finished_queues_select() -> Select[Any]:
    policies = _policies()
    cursors = arrays(
        "cursors", ("cursor_queues", "queue", Text()), ("cursor_afters", "after", TSTZ)
    )
    after = func.coalesce(cursors.c.after, cast(literal_column("'-infinity'"), TSTZ))
    t = tasks.alias("t")
    # One probe of ix_tasks_finished per queue: the first task past the cursor.
    unread = (
        select(t.c.id)
        .where(
            t.c.queue == policies.c.queue,
            _finished(t),
            t.c.completed_at > after,
            t.c.completed_at <= NOW - seconds(policies.c.idempotency_retention),
        )
        .exists()
    )
    return (
        select(policies.c.queue, policies.c.terminal_retention, policies.c.idempotency_retention)
        .select_from(policies.outerjoin(cursors, cursors.c.queue == policies.c.queue))
        .where(unread)
        .order_by(cursors.c.after.asc().nulls_first(), policies.c.queue)
    )


#: The queues (all, or only the bound ``queue`` when it is not NULL) with a terminal task
#: that finished after the queue's cursor and at least its idempotency retention ago: those
#: whose `DELETE_FINISHED_KEYS` window is not empty. Binds the cursors as parallel arrays
#: ``cursor_queues`` and ``cursor_afters`` (a queue without one reads from the oldest).
#: A loose index scan of ``ix_tasks_finished`` and one probe of it per queue, never a scan
#: of the terminal rows. Locks nothing. Returns ``(queue, terminal_retention,
#: idempotency_retention)`` (retentions in seconds, the column defaults for queues without a
#: row), the queues never read first, then the least recently read (the oldest cursor), so
#: that a pass cut short by its batch limit starts the next one where it stopped.
FINISHED_QUEUES: Final = _finished_queues_select()


def _deletable(
    t: FromClause, retention: ColumnElement[Any]
) -> list[ColumnElement[bool] | TextClause]:
    """``t`` may go with its family: a root, finished ``retention`` seconds ago, none kept."""
    return [
        _finished(t), t.c.completed_at <= NOW - seconds(retention), t.c.parent_id.is_(None),
        FREE_FAMILY,
    ]


def _finished_tasks(*, lock: bool) -> Select[Any]:
    """The batch's tasks (locked, keys free) or, without ``lock``, its candidate roots."""
    policies = _policies()
    limit = bindparam("limit", type_=Integer)
    t = tasks.alias("t")
    # Tasks a pass set aside (their deletion failed alone): never in its later batches.
    skipped = t.c.id != func.all(bindparam("skip", [], type_=ARRAY(UUID_T)))
    expired = (
        select(t.c.id, t.c.queue, t.c.idempotency_key, t.c.completed_at)
        .where(
            t.c.queue == policies.c.queue, *_deletable(t, policies.c.terminal_retention),
            skipped,
        )
        .order_by(t.c.completed_at)
        .limit(limit)
    )
    if lock:
        expired = expired.with_for_update(of=t, skip_locked=True)
    lateral = expired.lateral("expired")
    roots = (
        select(lateral.c.id, lateral.c.queue, lateral.c.completed_at)
        .select_from(policies.join(lateral, true()))
        .order_by(policies.c.queue)
        .limit(limit)
    )
    if not lock:
        return roots.with_only_columns(lateral.c.id)
    return families(roots.where(key_free(lateral)).subquery("chosen"), limit=limit)


def _delete_finished_task() -> ReturningDelete[Any]:
    t = tasks.alias("t")
    retention = func.coalesce(
        select(queues.c.terminal_retention_seconds)
        .where(queues.c.name == t.c.queue)
        .scalar_subquery(),
        DEFAULT_TERMINAL_RETENTION_SECONDS,
    )
    expired = (
        select(t.c.id, t.c.queue, t.c.idempotency_key, t.c.completed_at)
        .where(t.c.id == bindparam("task_id", type_=UUID_T), *_deletable(t, retention))
        .with_for_update(of=t, skip_locked=True)
        .subquery("expired")
    )
    chosen = (
        select(expired.c.id, expired.c.queue, expired.c.completed_at)
        .where(key_free(expired))
        .subquery("chosen")
    )
    return returning_delete(families(chosen, limit=None))


#: Deletes the workflow families whose every member is a terminal task whose ``completed_at``
#: is at least its queue's ``terminal_retention_seconds`` (604800 without a queue row) before
#: database time, each family whole in this one statement (a task without parent or child is
#: a family of one), about ``limit`` tasks: families in root order (oldest root first within a
#: queue, queues by name) until the count reaches ``limit``, the family that reaches it
#: included whole (a family is never split, so a batch may exceed ``limit`` by that
#: family's size less one). Binds ``queue`` (NULL: every queue; else only the families whose
#: members are all in it). Candidates are roots (`FREE_FAMILY`): queues from a loose index
#: scan of ``ix_tasks_finished``, each queue's candidates one range of that index (at most
#: ``limit`` roots), each root's family walked down through ``ix_tasks_parent`` (one probe per
#: member) to check it and then again to lock it (`members`). Locks the roots and members
#: ``FOR UPDATE SKIP LOCKED``, re-checked once locked (concurrent runs take disjoint families;
#: a family with a member another transaction holds, or an administrator is retrying, is
#: left whole for a later batch), and no other task row. One DELETE of a parent with its
#: children: ``tasks.parent_id ON DELETE SET NULL`` finds nothing to set. Cascades to the
#: tasks' attempts, checkpoints, signals and waits; ``tasks_idempotency_deleted`` writes
#: each key's expiry down (never releasing it); a terminal task holds no capacity, so the
#: capacity counter is untouched. Binds ``skip``, root ids never taken (an empty array:
#: none). Returns ``(id, queue, parent_id)`` of the deleted tasks.
DELETE_FINISHED_TASKS: Final = returning_delete(_finished_tasks(lock=True))

#: The ids of the roots whose families `DELETE_FINISHED_TASKS` would consider, with the same
#: binds; locks nothing. When a batch failed on a row another transaction holds (a history
#: row the cascade must delete, say), its families are tried one at a time
#: (`DELETE_FINISHED_TASK`).
FINISHED_TASK_CANDIDATES: Final = _finished_tasks(lock=False)

#: Deletes the family of root ``task_id`` whole when `DELETE_FINISHED_TASKS` could (every
#: member finished and past its queue's terminal retention, in ``queue`` unless it is NULL,
#: reservations free, none held by another transaction), locking it ``FOR UPDATE SKIP
#: LOCKED``. Returns ``(id, queue, parent_id)`` of the deleted tasks: none when it may not go.
DELETE_FINISHED_TASK: Final = _delete_finished_task()


def _delete_expired_keys() -> ReturningDelete[Any]:
    expired = (
        select(keys.c.queue, keys.c.key)
        .where(
            keys.c.expires_at.is_not(None),
            keys.c.expires_at <= NOW,
            _queue_filter(keys.c.queue),
        )
        .order_by(keys.c.expires_at)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .subquery("expired")
    )
    return (
        keys.delete()
        .where(keys.c.queue == expired.c.queue, keys.c.key == expired.c.key)
        .returning(keys.c.queue, keys.c.key)
    )


#: Deletes up to ``limit`` idempotency reservations whose written-down expiry (set when their
#: task was deleted, from its completion time plus the queue's idempotency retention) is at or
#: before database time, soonest expired first; binds ``queue`` (NULL: every queue). A range
#: of ``ix_idempotency_keys_expiry`` (with a queue, the other queues' expired keys in that
#: range are read and passed over). Locks the chosen key rows ``FOR UPDATE SKIP LOCKED``; a
#: producer taking a key over holds it and is skipped, and a key taken over since the
#: statement's snapshot no longer matches when its lock is granted. Returns ``(queue, key)``
#: of the deleted reservations.
DELETE_EXPIRED_KEYS: Final = _delete_expired_keys()


def _delete_finished_keys() -> Select[Any]:
    queue = bindparam("queue", type_=Text)
    after = func.coalesce(bindparam("after", type_=TSTZ), cast(literal_column("'-infinity'"), TSTZ))
    retention = func.coalesce(
        select(queues.c.idempotency_retention_seconds)
        .where(queues.c.name == queue)
        .scalar_subquery(),
        DEFAULT_IDEMPOTENCY_RETENTION_SECONDS,
    )
    cutoff = NOW - seconds(retention)

    def in_range(t: FromClause) -> list[ColumnElement[bool]]:
        return [t.c.queue == queue, _finished(t), t.c.completed_at > after,
                t.c.completed_at <= cutoff]

    b = tasks.alias("b")
    # The completion time of the scan_limit-th task after the cursor: the window ends there,
    # ties included, so the next window (strictly after it) misses none of them.
    bound = (
        select(b.c.completed_at)
        .where(*in_range(b))
        .order_by(b.c.completed_at)
        .offset(bindparam("scan_limit", type_=Integer) - 1)
        .limit(1)
        .scalar_subquery()
    )
    s = tasks.alias("s")
    scanned = (
        select(s.c.id, s.c.idempotency_key, s.c.completed_at)
        .where(*in_range(s), s.c.completed_at <= func.coalesce(bound, cutoff))
        .cte("scanned")
    )
    k = keys.alias("k")
    t = tasks.alias("t")
    # LATERAL: one primary-key probe per task read, never a join over the whole key table.
    # The task is locked too (FOR NO KEY UPDATE, as an administrative retry locks it), and
    # re-checked once locked: a task retried since the snapshot is live again, and so is its
    # key; one being retried right now is skipped.
    probe = (
        select(k.c.queue, k.c.key)
        .select_from(k.join(t, t.c.id == k.c.task_id))
        .where(
            k.c.queue == queue,
            k.c.key == scanned.c.idempotency_key,
            k.c.task_id == scanned.c.id,
            k.c.expires_at.is_(None),
            _finished(t),
            t.c.completed_at <= cutoff,
        )
        .with_for_update(of=[k, t], skip_locked=True, key_share=True)
        .lateral("probe")
    )
    doomed = select(probe.c.queue, probe.c.key).select_from(scanned.join(probe, true())).cte(
        "doomed"
    )
    deleted = (
        keys.delete()
        .where(keys.c.queue == doomed.c.queue, keys.c.key == doomed.c.key)
        .returning(keys.c.key)
        .cte("deleted")
    )
    return select(
        select(func.count()).select_from(deleted).scalar_subquery().label("deleted"),
        select(func.count()).select_from(scanned).scalar_subquery().label("scanned"),
        select(func.max(scanned.c.completed_at)).scalar_subquery().label("reached"),
    )


#: Deletes the idempotency reservations of queue ``queue`` whose task still exists but
#: finished at least the queue's ``idempotency_retention_seconds`` (2592000 without a queue
#: row) before database time: expired by `key_expired`'s derivation, with no expiry written
#: down yet. Reads one window of the queue's range of ``ix_tasks_finished``: the terminal
#: tasks completed after the cursor ``after`` (NULL: from the oldest) and up to the cutoff,
#: at most ``scan_limit`` of them plus the ties of the last completion time; each key is one
#: primary-key probe (``(queue, idempotency_key)``, of that task only). Locks each such key
#: row and its task ``FOR NO KEY UPDATE SKIP LOCKED`` and re-checks that the task is still
#: finished long enough ago: a task an administrator retried since the statement's snapshot
#: (live again, and so its key) is left alone, one being retried is skipped. Never waits for
#: a lock. Returns one row ``(deleted, scanned, reached)``:
#: keys deleted, tasks read, and the last completion time read (the next call's ``after``;
#: NULL when nothing was read). ``scanned < scan_limit`` means the window reached the cutoff.
DELETE_FINISHED_KEYS: Final = _delete_finished_keys()
