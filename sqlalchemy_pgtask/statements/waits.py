"""statements.waits: signals, child-result waits and their timeouts; no I/O.

A wait is registered in one transaction that first locks the waiting task row (`LOCK_FOR_WAIT`)
and then, with a fresh snapshot, either finds what it waits for (and checkpoints it) or stores
the wait and suspends the attempt. Whatever resolves a wait (a signal's trigger, a child's end,
the timeout pass) locks the task row first too, so the two never miss each other.

Lock order: a change of a waiting task locks the task row before it reads or deletes the
task's wait. Registering a result wait locks the parent, then the child (``FOR SHARE``); a task
that ends locks its descendants after itself (trigger ``tasks_cancel_descendants``); a child
that ends locks its waiting parent after itself but never waits for it (trigger
``tasks_child_finished``, ``NOWAIT``); the timeout pass skips what others hold. The cascade's
order among descendants follows its plan; a deadlock PostgreSQL detects there aborts one side,
which the worker retries.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    CTE,
    ColumnElement,
    CompoundSelect,
    Double,
    Integer,
    Select,
    Text,
    case,
    cast,
    exists,
    false,
    func,
    literal_column,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from sqlalchemy_pgtask.statements._common import (
    NOW,
    UUID_T,
    checkpoints,
    not_aside,
    seconds,
    signals,
    tasks,
    waits,
)
from sqlalchemy_pgtask.statements._fence import (
    CHECKPOINT_KEY,
    KEEP_FIRST,
    bind,
    const,
    fenced,
    has_rows,
    key_binds,
    states,
    suspend,
    task_bind,
)
from sqlalchemy_pgtask.states import ACTIVE_STATES, TERMINAL_STATES

__all__ = [
    "DUE_WAITS",
    "EMIT_SIGNAL",
    "LOCK_CHILD",
    "LOCK_FOR_WAIT",
    "NEXT_WAIT_TIMEOUT",
    "REGISTER_RESULT_WAIT",
    "REGISTER_SIGNAL_WAIT",
    "WAIT_TIMEOUT",
    "WAIT_TIMEOUTS",
]


# -- signals -------------------------------------------------------------------------------

#: Locks this attempt's task row ``FOR UPDATE`` before a wait is registered in the same
#: transaction. The lock conflicts with the key-share lock that a signal's foreign key (and
#: a child's) takes on the task, so an emitter either committed before (and the next
#: statement's fresh snapshot sees its signal) or waits until the wait is committed (and its
#: trigger then sees the wait). Returns ``(cancel)`` while the lease holds, no row otherwise.
#: Binds ``task``, ``attempt_number``, ``token``.
LOCK_FOR_WAIT: Final = (
    fenced(tasks.c.cancel_requested_at.is_not(None).label("cancel"))
    .with_for_update(of=tasks)
)


def _register_wait(
    found: CTE, kind: str, value: ColumnElement[Any], wait: dict[str, ColumnElement[Any]]
) -> Select[Any]:
    """Checkpoint what ``found`` holds (one row: the awaited event already happened) as
    ``value``, or store a wait with the ``wait`` columns and suspend the attempt."""
    # Must follow LOCK_FOR_WAIT in the same transaction (that lock is the fence: this
    # unlocked check only repeats it, to write nothing once the lease is gone).
    fence = fenced(tasks.c.id).cte("fence")
    stored = (
        pg_insert(checkpoints)
        .from_select(
            [*CHECKPOINT_KEY, "kind", "value"],
            select(fence.c.id, *key_binds()[1:], const(kind), value)
            .select_from(fence.join(found, true())),
        )
        .on_conflict_do_update(**KEEP_FIRST)
        .returning(checkpoints.c.value)
        .cte("stored")
    )
    waiting = (
        pg_insert(waits)
        .from_select(
            ["task_id", "kind", "version", "step", "occurrence", *wait, "timeout_at"],
            select(
                fence.c.id, const("child" if kind == "result" else kind), *key_binds()[1:],
                *wait.values(), NOW + seconds(bind("timeout", Double)),
            ).where(~has_rows(found)),
        )
        .returning(waits.c.task_id)
        .cte("wait")
    )
    moved, recorded = suspend(fence, "waiting", has_rows(waiting))
    return select(
        has_rows(fence).label("held"),
        select(stored.c.value).scalar_subquery().label("value"),
        has_rows(moved).label("waiting"),
    ).add_cte(recorded)


def _register_signal_wait() -> Select[Any]:
    signal = (
        select(signals.c.value)
        .where(
            signals.c.task_id == task_bind(),
            signals.c.name == bind("signal", Text),
            signals.c.occurrence == bind("signal_occurrence", Integer),
        )
        .cte("signal")
    )
    return _register_wait(
        signal,
        "signal",
        func.jsonb_build_object(const("signal"), signal.c.value),
        {
            "signal_name": bind("signal", Text),
            "signal_occurrence": bind("signal_occurrence", Integer),
        },
    )


#: Registers a signal wait, after `LOCK_FOR_WAIT` in the same transaction: if the signal
#: (``signal``, ``signal_occurrence``) is already there, its value becomes the step's checkpoint
#: ``{"signal": value}`` and nothing suspends; otherwise a wait with ``timeout`` seconds of
#: database time (None: for ever) is stored, the task is ``waiting`` and the attempt suspended.
#: Returns ``(held, value, waiting)``. Binds `DurableParams`, ``signal``,
#: ``signal_occurrence``, ``timeout``.
REGISTER_SIGNAL_WAIT: Final = _register_signal_wait()


def _emit_signal() -> Select[Any]:
    # Only for a task this statement sees: the foreign key's check would fail on any other
    # with an error that aborts the caller's transaction, and under REPEATABLE READ or
    # SERIALIZABLE it cannot tell a task committed after the snapshot from no task at all.
    target = select(tasks.c.id).where(tasks.c.id == task_bind()).cte("target")
    stored = (
        pg_insert(signals)
        .from_select(
            ["task_id", "name", "occurrence", "value"],
            select(
                target.c.id,
                bind("signal", Text),
                bind("signal_occurrence", Integer),
                cast(bind("signal_value", Text), JSONB),
            ),
        )
        # Takes the row lock of an existing signal and returns it: the first value wins.
        .on_conflict_do_update(
            index_elements=["task_id", "name", "occurrence"], set_={"value": signals.c.value}
        )
        .returning(signals.c.value)
        .cte("stored")
    )
    return select(
        select(stored.c.value).scalar_subquery().label("value"),
        has_rows(target).label("found"),
        func.current_setting(const("transaction_isolation")).label("isolation"),
    )


#: Stores a signal for a task unless one with the same (name, occurrence) exists; either way
#: returns the stored ``value``. Its trigger wakes the task if it waits for this signal. The
#: foreign key takes a key-share lock on the task row. A task the statement does not see is
#: left alone (nothing fails, nothing is written): ``found`` is false, and ``isolation`` (the
#: transaction's level) says whether that may be a task committed after the caller's
#: snapshot. Returns ``(value, found, isolation)``. Binds ``task``, ``signal``,
#: ``signal_occurrence``, ``signal_value`` (JSON text).
EMIT_SIGNAL: Final = _emit_signal()



#: The child's parent and state, locked ``FOR SHARE`` (after the parent's `LOCK_FOR_WAIT`, in
#: the same transaction): a child cannot finish unseen while its parent registers a wait for it.
#: Binds ``child_id``; returns ``(parent_id, state)`` or no row.
LOCK_CHILD: Final = (
    select(tasks.c.parent_id, tasks.c.state)
    .where(tasks.c.id == bind("child_id", UUID_T))
    .with_for_update(read=True)
)


def _register_result_wait() -> Select[Any]:
    finished = (
        select(tasks.c.state, tasks.c.result, tasks.c.error)
        .where(
            tasks.c.id == bind("child_id", UUID_T),
            tasks.c.state.in_(states(TERMINAL_STATES)),
        )
        .cte("finished")
    )
    return _register_wait(
        finished,
        "result",
        func.jsonb_build_object(
            const("state"), finished.c.state, const("result"), finished.c.result,
            const("error"), finished.c.error,
        ),
        {"child_id": bind("child_id", UUID_T)},
    )


#: Registers a wait for a direct child's result, after `LOCK_FOR_WAIT` and `LOCK_CHILD` in the
#: same transaction: a finished child's ``{"state", "result", "error"}`` becomes the step's
#: checkpoint at once; otherwise a wait with ``timeout`` seconds of database time (None: for
#: ever) is stored, the parent is ``waiting`` and the attempt suspended. Returns ``(held,
#: value, waiting)``. Binds `DurableParams`, ``child_id``, ``timeout``.
REGISTER_RESULT_WAIT: Final = _register_result_wait()


# -- wait timeouts (maintenance) -----------------------------------------------------------


def _wait_timeouts(*, one: bool) -> CompoundSelect[Any]:
    # Every row this statement changes is locked first with SKIP LOCKED (the waiting task, its
    # child and the child's whole subtree), so it never waits for another transaction: a wait
    # whose rows are not all free is reported held and left for a later pass, and the others
    # in the batch go ahead. FOR NO KEY UPDATE, as the update itself: a weaker lock taken
    # here would let a transaction that holds the row (an open cancel()) make it wait anyway.
    chosen = (
        waits.c.task_id == bind("task", UUID_T) if one
        else not_aside(waits.c.task_id)
    )
    due = (
        select(waits.c.task_id, waits.c.kind, waits.c.version, waits.c.step,
               waits.c.occurrence, waits.c.child_id)
        .select_from(waits.join(tasks, tasks.c.id == waits.c.task_id))
        .where(waits.c.timeout_at <= NOW, tasks.c.state == const("waiting"), chosen)
        .order_by(waits.c.timeout_at)
        .limit(bind("limit", Integer) if not one else 1)
        .with_for_update(key_share=True, skip_locked=True, of=tasks)
        .cte("due")
    )
    # The timed-out children and all their descendants, each with the task whose wait timed
    # out, read in one walk: one probe of ix_tasks_parent per task, in a lateral subquery the
    # planner cannot flatten (OFFSET 0) into a join it may plan as a scan of the whole table
    # per level (n^2 on a deep chain, when its estimate is tiny after a large insert).
    base = (
        select(due.c.child_id.label("id"), due.c.task_id.label("waiter"))
        .where(due.c.child_id.is_not(None))
        .cte("subtree", recursive=True)
    )
    below = tasks.alias("below")
    children = select(below.c.id).where(below.c.parent_id == base.c.id).offset(0)
    step = children.lateral("children")
    subtree = base.union_all(
        select(step.c.id, base.c.waiter).select_from(base.join(step, true()))
    )
    active = (
        select(subtree.c.id, subtree.c.waiter)
        .join(tasks, tasks.c.id == subtree.c.id)
        .where(tasks.c.state.in_(states(ACTIVE_STATES)))
        .cte("active")
    )
    locked = (
        select(tasks.c.id)
        .where(tasks.c.id.in_(select(active.c.id)), tasks.c.state.in_(states(ACTIVE_STATES)))
        .with_for_update(key_share=True, skip_locked=True)
        .cte("locked")
    )
    # Anti-joins, never NOT IN (a subplan that may probe a 100,000-row list per row).
    unlocked = ~exists().where(locked.c.id == active.c.id)
    held = select(active.c.waiter).where(unlocked).distinct().cte("held")
    ready = select(due).where(~exists().where(held.c.waiter == due.c.task_id)).cte("ready")
    doomed = (
        select(active.c.id, active.c.waiter)
        .where(active.c.waiter.in_(select(ready.c.task_id)))
        .cte("doomed")
    )
    timed_out = case(
        (ready.c.kind == const("signal"),
         cast(literal_column("""'{"timeout": true}'"""), JSONB)),
        else_=cast(
            literal_column("""'{"state": "timeout", "result": null, "error": null}'"""), JSONB
        ),
    )
    stored = (
        pg_insert(checkpoints)
        .from_select(
            [*CHECKPOINT_KEY, "kind", "value"],
            select(
                ready.c.task_id, ready.c.version, ready.c.step, ready.c.occurrence,
                case((ready.c.kind == literal_column("'signal'"), const("signal")),
                     else_=const("result")),
                timed_out,
            ),
        )
        .on_conflict_do_nothing(index_elements=list(CHECKPOINT_KEY))
        .cte("stored")
    )
    # A parent that is itself in such a subtree is cancelled below instead.
    woken = (
        update(tasks)
        .where(
            tasks.c.id.in_(select(ready.c.task_id)),
            ~exists().where(doomed.c.id == tasks.c.id),
        )
        .values(state=const("pending"), run_at=NOW, updated_at=NOW)
        .returning(tasks.c.id)
        .cte("woken")
    )
    at_rest = tasks.c.state.in_(states(("pending", "waiting")))
    # A running one only gets a cancel request, so its subtree is cancelled here too rather
    # than when it ends. Times never go back (see statements.admin's cancel).
    at = func.greatest(NOW, tasks.c.updated_at)
    cancelled = (
        update(tasks)
        .where(tasks.c.id == doomed.c.id, tasks.c.state.in_(states(ACTIVE_STATES)))
        .values(
            state=case((at_rest, const("cancelled")), else_=tasks.c.state),
            cancel_requested_at=func.coalesce(tasks.c.cancel_requested_at, at),
            completed_at=case((at_rest, at), else_=tasks.c.completed_at),
            error=case(
                (at_rest, func.jsonb_build_object(
                    const("type"), const("cancelled"), const("reason"),
                    const("result_wait_timeout"), const("waiter_id"), doomed.c.waiter,
                )),
                else_=tasks.c.error,
            ),
            updated_at=at,
        )
        .returning(tasks.c.id)
        .cte("cancelled")
    )
    return (
        select(woken.c.id, false().label("held"))
        .union_all(select(held.c.waiter, true()))
        .add_cte(stored)
        .add_cte(cancelled)
    )


#: Times out up to ``limit`` due waits, except those of the tasks in ``aside`` (default none):
#: the step's checkpoint becomes ``{"timeout": true}`` (a signal wait) or ``{"state":
#: "timeout", ...}`` (a child wait), the task is pending at once, and a timed-out child and its
#: unfinished descendants are cancelled (running ones by a cancel request), with error
#: ``{"type": "cancelled", "reason": "result_wait_timeout", "waiter_id": ...}``. Never waits
#: for a lock: it locks the waiting tasks, then their children's subtrees, with ``SKIP
#: LOCKED``; a wait whose subtree another transaction holds in part is left as it is. Served
#: by ``ix_waits_timeout_at``. Returns ``(id, held)``: per task woken (``held`` false), and
#: per task whose wait is due but held back (``held`` true).
WAIT_TIMEOUTS: Final = _wait_timeouts(one=False)

#: `WAIT_TIMEOUTS` for the one task ``task`` (if its wait is due): tried alone after a batch
#: failed (past ``statement_timeout``, say), so one wait never holds back the others.
WAIT_TIMEOUT: Final = _wait_timeouts(one=True)

#: The tasks of up to ``limit`` due waits, earliest first, except those in ``aside``. Locks
#: nothing.
DUE_WAITS: Final = (
    select(waits.c.task_id)
    .where(
        waits.c.timeout_at <= NOW,
        not_aside(waits.c.task_id),
    )
    .order_by(waits.c.timeout_at)
    .limit(bind("limit", Integer))
)

#: Seconds of database time until the earliest wait times out (negative: overdue), or NULL
#: when no wait has a timeout, leaving out the tasks in ``aside`` (default none). Served by
#: ``ix_waits_timeout_at``; locks nothing.
NEXT_WAIT_TIMEOUT: Final = select(
    func.extract("epoch", func.min(waits.c.timeout_at) - NOW).label("seconds")
).where(
    waits.c.timeout_at.is_not(None),
    not_aside(waits.c.task_id),
)
