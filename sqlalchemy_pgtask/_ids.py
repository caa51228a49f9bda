"""_ids: task ids, made in Python so a statement needs no ``RETURNING`` to tell the caller.

Time-ordered UUIDs (RFC 9562 version 7): new ids land at the right edge of the primary-key
index instead of at random pages, which keeps bulk enqueues cache-friendly.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Final

__all__ = ["new_ids"]


#: Read once: an enum member's attribute lookup costs as much as the rest of an id.
_UNKNOWN: Final = uuid.SafeUUID.unknown


def _uuid_from_int(value: int) -> uuid.UUID:
    # What ``UUID(int=value)`` builds, without its argument parsing: two thirds of the cost
    # of an id. ``value`` is in range by construction.
    made = object.__new__(uuid.UUID)
    object.__setattr__(made, "int", value)
    object.__setattr__(made, "is_safe", _UNKNOWN)
    return made


def _id_maker() -> Callable[[int], uuid.UUID]:
    """`_uuid_from_int` if it makes the same UUID as the constructor here, else the
    constructor (a Python whose UUID is laid out otherwise)."""
    probe = 0x0190_D3F8_5C1E_7ABC_9DEF_0123_4567_89AB
    try:
        made, built = _uuid_from_int(probe), uuid.UUID(int=probe)
        if made == built and str(made) == str(built) and made.is_safe is built.is_safe:
            return _uuid_from_int
    except (AttributeError, TypeError):  # slots named otherwise
        pass
    return lambda value: uuid.UUID(int=value)


_uuid: Final = _id_maker()
#: The bits of a version 7 UUID that are random: ``rand_a`` (12) and ``rand_b`` (62); the
#: others hold the millisecond, the version and the variant.
_RANDOM: Final = ((1 << 12) - 1) << 64 | ((1 << 62) - 1)


def new_ids(count: int) -> list[uuid.UUID]:
    """``count`` version 7 UUIDs, with one read of randomness for the batch. The clock only
    orders ids; no deadline uses it."""
    stamp = (time.time_ns() // 1_000_000 & ((1 << 48) - 1)) << 80 | 0x7 << 76 | 0b10 << 62
    randomness = os.urandom(16 * count)
    return [
        _uuid(stamp | int.from_bytes(randomness[at : at + 16], "big") & _RANDOM)
        for at in range(0, 16 * count, 16)
    ]
