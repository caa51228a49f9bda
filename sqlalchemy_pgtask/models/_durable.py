"""models._durable: what durable handlers keep: step checkpoints, signals, and current waits."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any, Final

from sqlalchemy import CheckConstraint, ForeignKey, Index, Integer, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from sqlalchemy_pgtask.models._base import NOW, Base, name_check, quoted, size_check
from sqlalchemy_pgtask.validation import (
    SIGNAL_MAX_BYTES,
    STEP_NAME_MAX_BYTES,
    TASK_NAME_MAX_BYTES,
)

__all__ = [
    "CHECKPOINT_KINDS",
    "CHECKPOINT_STORED_MAX_BYTES",
    "WAIT_KINDS",
    "Checkpoint",
    "Signal",
    "Wait",
    "sleep_deadline",
    "wake_time",
]

#: What wrote a checkpoint: a step's result, a sleep's wake time, a signal (or its timeout), a
#: spawned child's id, a child's result (or its timeout), a fenced transaction's commit.
CHECKPOINT_KINDS: Final = ("step", "sleep", "signal", "spawn", "result", "transaction")
#: What a waiting task waits for.
WAIT_KINDS: Final = ("signal", "child")
#: A stored checkpoint may hold a step's value (at most 1 MiB), a signal's, or a child's result
#: and error together, so the column allows twice a step's limit.
CHECKPOINT_STORED_MAX_BYTES: Final = 2 * 1024 * 1024


#: The fraction of a second in PostgreSQL's JSON timestamps, which drops trailing zeros
#: (``12:00:00.5+00:00``); Python 3.10's ``fromisoformat`` reads only 3 or 6 digits.
_FRACTION: Final = re.compile(r"\.(\d{1,6})(?=[+-]|$)")


def wake_time(kind: str, value: Any) -> datetime | None:
    """The wake time a ``sleep`` checkpoint stored (``{"wake_at": ...}``); None otherwise.

    None too for a value that does not hold a timezone-aware ISO 8601 time (the library
    writes none such, but a checkpoint is an ordinary row).
    """
    if kind != "sleep" or not isinstance(value, dict):
        return None
    stored = value.get("wake_at")
    if not isinstance(stored, str):
        return None
    text = _FRACTION.sub(lambda m: "." + m.group(1).ljust(6, "0"), stored, count=1)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def sleep_deadline(
    state: str, run_at: datetime, latest_kind: str | None, latest_value: Any
) -> datetime | None:
    """When a task in a durable sleep wakes, from its state, ``run_at`` and latest checkpoint.

    Asleep means ``pending`` with a latest checkpoint that is a ``sleep`` whose wake time is
    the task's ``run_at``: every path that makes a task pending again after it ran (a retry,
    a lost lease, a release, a resolved wait) sets ``run_at`` anew. The wake time may have
    passed already (the caller cannot know database time): the task then waits for a claim.
    """
    if state != "pending" or latest_kind is None:
        return None
    wake = wake_time(latest_kind, latest_value)
    return wake if wake is not None and wake == run_at else None


def _step_check(column: str) -> str:
    # Step names are free text (they often carry an application id) but bounded, and never
    # hold NUL, which PostgreSQL's text rejects anyway.
    return f"octet_length({column}) BETWEEN 1 AND {STEP_NAME_MAX_BYTES}"


class Checkpoint(Base):
    """The stored outcome of one durable call of a handler, keyed so a replay finds it.

    The key is the task, the handler version and the step's name and occurrence: a new handler
    version replays nothing of an older one. The first committed value wins and is never
    changed.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (
        CheckConstraint(_step_check("step"), name="step"),
        CheckConstraint("occurrence >= 0", name="occurrence"),
        CheckConstraint(f"kind IN ({quoted(CHECKPOINT_KINDS)})", name="kind"),
        CheckConstraint(size_check("value", CHECKPOINT_STORED_MAX_BYTES), name="value_size"),
    )

    task_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("pgtask.tasks.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[str] = mapped_column(Text, primary_key=True)
    occurrence: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(Text)
    value: Mapped[Any] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)

    @property
    def wake_at(self) -> datetime | None:
        """The wake time of a ``sleep`` checkpoint; None for every other kind."""
        return wake_time(self.kind, self.value)


class Signal(Base):
    """An immutable, named event addressed to one task; it may arrive before anyone waits."""

    __tablename__ = "signals"
    __table_args__ = (
        CheckConstraint(name_check("name", TASK_NAME_MAX_BYTES), name="name"),
        CheckConstraint("occurrence >= 0", name="occurrence"),
        CheckConstraint(size_check("value", SIGNAL_MAX_BYTES), name="value_size"),
    )

    task_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("pgtask.tasks.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    occurrence: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[Any] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)


class Wait(Base):
    """What a ``waiting`` task waits for: a signal, or the result of one of its children.

    At most one per task. It goes away when the task leaves ``waiting`` (resolved, timed
    out, or cancelled), so a stale wait can never fire later.
    """

    __tablename__ = "waits"
    __table_args__ = (
        CheckConstraint(f"kind IN ({quoted(WAIT_KINDS)})", name="kind"),
        CheckConstraint(_step_check("step"), name="step"),
        CheckConstraint(
            "(kind = 'signal') = (signal_name IS NOT NULL AND signal_occurrence IS NOT NULL)",
            name="signal",
        ),
        CheckConstraint("(kind = 'child') = (child_id IS NOT NULL)", name="child"),
        Index("ix_waits_timeout_at", "timeout_at", postgresql_where=text("timeout_at IS NOT NULL")),
    )

    task_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("pgtask.tasks.id", ondelete="CASCADE"), primary_key=True
    )
    kind: Mapped[str] = mapped_column(Text)
    #: The checkpoint the resolution writes: (task, version, step, occurrence).
    version: Mapped[int] = mapped_column(Integer)
    step: Mapped[str] = mapped_column(Text)
    occurrence: Mapped[int] = mapped_column(Integer)
    signal_name: Mapped[str | None] = mapped_column(Text)
    signal_occurrence: Mapped[int | None] = mapped_column(Integer)
    child_id: Mapped[uuid.UUID | None]
    #: Database time when the wait gives up (the step then sees a timeout); None: never.
    timeout_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(server_default=NOW)
