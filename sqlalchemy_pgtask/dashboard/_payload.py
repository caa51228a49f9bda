"""dashboard._payload: the task list's search by payload, a JSON containment filter
(``payload @> '{"order_id": 42}'``); parses and checks, never reads the database.

No index serves it: a GIN index on ``payload`` would cost every enqueue on the hottest table
for a search operators make now and then. So the filter is bounded like state, queue and
name (`_task_list`): a page applies it within one range of at most ``scan_limit`` tasks of
``ix_tasks_created`` below its cursor, and says how far back it looked.
"""

from __future__ import annotations

import json
from typing import Any, Final

from sqlalchemy import String, cast, literal
from sqlalchemy.dialects.postgresql import JSONB

from sqlalchemy_pgtask.errors import InvalidOptionError, PayloadError
from sqlalchemy_pgtask.models import Task
from sqlalchemy_pgtask.validation import dump_json

__all__ = ["PAYLOAD_FILTER_MAX_BYTES", "PayloadFilter", "contains", "parse_payload_filter"]

#: The longest payload filter, in UTF-8 bytes of its text: a few keys and values, not a
#: document. The same bound applies to the jsonb text it is sent as.
PAYLOAD_FILTER_MAX_BYTES: Final = 2048
_FIELD: Final = "payload"


class PayloadFilter:
    """A checked containment filter: a non-empty JSON object, and its jsonb text."""

    __slots__ = ("text", "value")

    def __init__(self, value: object) -> None:
        if not isinstance(value, dict):
            kind = type(value).__name__
            raise InvalidOptionError(_FIELD, f"must be a JSON object, like {{\"order_id\": 42}}; "
                                             f"got a {kind}")
        if not value:
            raise InvalidOptionError(_FIELD, "{} matches every task: name a key")
        try:
            self.text = dump_json(_FIELD, value, PAYLOAD_FILTER_MAX_BYTES)
        except PayloadError as exc:
            raise InvalidOptionError(_FIELD, str(exc)) from exc
        self.value: dict[str, Any] = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PayloadFilter) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"PayloadFilter({self.text})"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_payload_filter(raw: str | None) -> PayloadFilter | None:
    """The filter the task list's ``payload`` field holds, or None when it is empty; an
    `InvalidOptionError` (a 400) for anything but a JSON object within the size limit."""
    if raw is None or not raw.strip():
        return None
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidOptionError(_FIELD, "contains an unpaired surrogate character") from exc
    if size > PAYLOAD_FILTER_MAX_BYTES:
        raise InvalidOptionError(
            _FIELD, f"is {size} bytes; the limit is {PAYLOAD_FILTER_MAX_BYTES}"
        )
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise InvalidOptionError(_FIELD, "is nested too deeply") from exc
    except ValueError as exc:
        raise InvalidOptionError(_FIELD, f"is not JSON: {str(exc)[:120]}") from exc
    return PayloadFilter(value)


def contains(payload: PayloadFilter) -> Any:
    """``payload @> CAST(:text AS jsonb)``: the tasks whose payload holds every key of the
    filter with an equal (or, for objects and arrays, containing) value."""
    return Task.payload.op("@>")(cast(literal(payload.text, String), JSONB))
