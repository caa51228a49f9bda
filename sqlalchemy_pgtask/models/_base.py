"""models._base: the metadata (schema ``pgtask``, naming convention), the declarative base, and
the CHECK texts the tables share."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    MetaData,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID
from sqlalchemy.orm import DeclarativeBase

from sqlalchemy_pgtask.validation import (
    CONCURRENCY_KEY_MAX_BYTES,
    DURATION_MAX_SECONDS,
    NAME_PATTERN,
)

__all__ = [
    "FAST_AUTOVACUUM",
    "NOW",
    "RETRY_KINDS",
    "SCHEMA",
    "TS",
    "Base",
    "concurrency_key_check",
    "concurrency_limit_check",
    "metadata",
    "name_check",
    "positive_duration_check",
    "quoted",
    "retry_shape_check",
    "size_check",
]

SCHEMA: Final = "pgtask"

RETRY_KINDS: Final = ("never", "fixed", "exponential")

metadata = MetaData(
    schema=SCHEMA,
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    },
)

NOW: Final = text("statement_timestamp()")
FAST_AUTOVACUUM: Final = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_analyze_threshold": "1000",
}
TS = TIMESTAMP(timezone=True)


def quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def name_check(column: str, max_bytes: int) -> str:
    return f"{column} ~ '{NAME_PATTERN}' AND octet_length({column}) <= {max_bytes}"


def positive_duration_check(column: str) -> str:
    return f"({column} > 0 AND {column} <= {DURATION_MAX_SECONDS})"


def size_check(column: str, max_bytes: int) -> str:
    return f"octet_length({column}::text) <= {max_bytes}"


def concurrency_key_check() -> str:
    return (
        "concurrency_key IS NULL"
        f" OR octet_length(concurrency_key) BETWEEN 1 AND {CONCURRENCY_KEY_MAX_BYTES}"
    )


def concurrency_limit_check() -> str:
    """A limit only with a key (``tasks`` and ``schedules``)."""
    return (
        "concurrency_limit IS NULL"
        " OR (concurrency_limit > 0 AND concurrency_key IS NOT NULL)"
    )


def retry_shape_check(prefix: str = "retry_") -> str:
    """Legal retry-policy shapes; the same rule guards handler policies and task snapshots."""
    kind, base, factor, cap = (
        f"{prefix}kind", f"{prefix}base_seconds", f"{prefix}factor", f"{prefix}max_seconds",
    )
    return (
        f"({kind} IS NULL AND {base} IS NULL AND {factor} IS NULL AND {cap} IS NULL)"
        f" OR ({kind} = 'never' AND {base} IS NULL AND {factor} IS NULL AND {cap} IS NULL)"
        f" OR ({kind} = 'fixed' AND {base} >= 0 AND {factor} IS NULL AND {cap} IS NULL)"
        f" OR ({kind} = 'exponential' AND {base} >= 0 AND {factor} >= 1 AND {cap} >= {base})"
    )


class Base(DeclarativeBase):
    """Declarative base for the pgtask tables; separate from the application's own base."""

    metadata = metadata
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        datetime: TS,
        uuid.UUID: UUID(as_uuid=True),
        dict[str, Any]: JSONB,
    }

