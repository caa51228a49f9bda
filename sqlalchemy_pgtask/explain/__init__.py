"""explain: why a task is not running now, in plain words, from the database alone.

`api` holds the calls; `facts` gathers what the database says about a task in one read, and
`reasons` turns those facts into the reasons `explain` returns. See ``docs/explain.md``.
"""

from __future__ import annotations

from sqlalchemy_pgtask.explain.api import (
    REASON_CODES,
    Explanation,
    Reason,
    ReasonCode,
    WorkerSlots,
    explain,
    explain_async,
)

__all__ = [
    "REASON_CODES",
    "Explanation",
    "Reason",
    "ReasonCode",
    "WorkerSlots",
    "explain",
    "explain_async",
]
