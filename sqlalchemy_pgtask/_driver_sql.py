"""_driver_sql: hot statements sent to psycopg as text compiled once; no I/O of its own.

`Connection.execute` of a construct looks up its compiled form and processes every parameter
on each execution: for a single enqueue or a worker's claim, much of SQLAlchemy's cost per
statement. A statement whose parameters need no conversion on the way can go to the driver as
the same text with `Connection.exec_driver_sql` instead, which still fires the cursor events,
echoes, wraps errors, begins the transaction and invalidates a lost connection.

Array parameters of plain element types (uuid, integers, floats, text, booleans) go in
psycopg's binary format (``%(name)b``): its text format quotes and escapes every element in
Python (a regular expression search each), ~4 us per task for a batch of completions, where
the binary format packs them at ~1 us. The server receives the same values (the statement
casts each array to its type either way).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from sqlalchemy import Boolean, Connection, CursorResult, Float, Integer, String, Uuid
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import BindParameter

__all__ = ["DriverStatement", "driver_statement", "execute", "execute_async"]


class DriverStatement(NamedTuple):
    """A statement as the driver gets it: its text, and how to complete the caller's values."""

    sql: str
    #: Values of the construct's own literals (``state="running"``), which compile to
    #: parameters of their own.
    literals: Mapping[str, Any]
    #: Array parameters: sent as lists, as SQLAlchemy would (psycopg adapts lists, not tuples).
    arrays: tuple[str, ...]

    def parameters(self, params: Mapping[str, Any]) -> Mapping[str, Any]:
        if not self.literals and not self.arrays:
            return params
        merged = {**self.literals, **params}
        for key in self.arrays:
            value = merged.get(key)
            if value is not None and type(value) is not list:
                merged[key] = list(value)
        return merged


def driver_statement(
    connection: Connection | AsyncConnection, statement: Executable
) -> DriverStatement | None:
    """``statement`` compiled once for ``connection``'s driver, or None where that is unsafe.

    Only for psycopg (its named ``pyformat`` parameters take the same dictionary) and for
    statements whose parameters need no conversion but lists for arrays; never under a
    ``schema_translate_map``, which only compilation applies, nor on a connection with
    ``before_execute`` or ``after_execute`` listeners, which `exec_driver_sql` skips.
    """
    sync = connection.sync_connection if isinstance(connection, AsyncConnection) else connection
    if sync is None:
        return None
    dialect = sync.dialect
    if (
        dialect.driver != "psycopg"
        or sync.get_execution_options().get("schema_translate_map")
        # A caller listening to these two events keeps seeing every statement.
        or sync.dispatch.before_execute
        or sync.dispatch.after_execute
    ):
        return None
    by_statement = _COMPILED.get(dialect)
    if by_statement is None:
        by_statement = _COMPILED[dialect] = {}
    try:
        return by_statement[statement]
    except KeyError:
        prepared = by_statement[statement] = _compiled_for_driver(statement, dialect)
        return prepared


def execute(
    connection: Connection, statement: Executable, params: Mapping[str, Any]
) -> CursorResult[Any]:
    """``connection.execute(statement, params)``, as text compiled once where that is safe."""
    prepared = driver_statement(connection, statement)
    if prepared is None:
        return connection.execute(statement, params)
    return connection.exec_driver_sql(prepared.sql, prepared.parameters(params))


async def execute_async(
    connection: AsyncConnection, statement: Executable, params: Mapping[str, Any]
) -> CursorResult[Any]:
    """`execute` on an `AsyncConnection`."""
    prepared = driver_statement(connection, statement)
    if prepared is None:
        return await connection.execute(statement, params)
    return await connection.exec_driver_sql(prepared.sql, prepared.parameters(params))


#: `driver_statement`'s forms per dialect (one per engine) and statement; None: not safe.
_COMPILED: Final[weakref.WeakKeyDictionary[Dialect, dict[Executable, DriverStatement | None]]] = (
    weakref.WeakKeyDictionary()
)


def _compiled_for_driver(statement: Executable, dialect: Dialect) -> DriverStatement | None:
    compiled = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
    if (
        dialect.paramstyle != "pyformat"
        or compiled.positiontup
        # Parameters the compiled path renames, or fills in from Python-side column defaults.
        or compiled.escaped_bind_names
        or compiled.insert_prefetch
        or compiled.update_prefetch
    ):
        return None
    literals: dict[str, Any] = {}
    arrays: list[str] = []
    binary: set[str] = set()
    # Every parameter object, not one per name: objects sharing a name must each be safe.
    for bind, name in compiled.bind_names.items():
        if bind.expanding or bind.literal_execute or bind.callable is not None:
            return None
        if not bind.required:
            literals[name] = bind.effective_value
        kind = _conversion(bind, dialect)
        if kind in ("array", "binary array"):
            arrays.append(name)
            if kind == "binary array":
                binary.add(name)
        elif kind is not None:
            return None
    sql = str(compiled.string)
    if binary:
        sql = re.sub(
            r"(?<!%)%\((" + "|".join(map(re.escape, sorted(binary))) + r")\)s", r"%(\1)b", sql
        )
    return DriverStatement(sql, literals, tuple(arrays))


#: Array element types psycopg packs in binary exactly as it would quote them in text: the same
#: Python types are accepted and refused (a list mixing int and float fails either way).
_BINARY_ITEMS: Final = (Uuid, Integer, Float, String, Boolean)


def _conversion(bind: BindParameter[Any], dialect: Dialect) -> str | None:
    """None: the value goes as it is; "array" or "binary array": as a list (in psycopg's text
    or binary format); anything else: it needs SQLAlchemy."""
    impl = bind.type.dialect_impl(dialect)
    if impl.bind_processor(dialect) is None:
        return None
    if isinstance(impl, ARRAY) and impl.dimensions in (None, 1):
        item = impl.item_type.dialect_impl(dialect)
        # SQLAlchemy's processor only makes it a list (the library's arrays are flat: only the
        # outer sequence is converted here); a Boolean item's only checks that it is a bool,
        # which psycopg sends as one (RetryPolicy refuses a jitter that is not a bool).
        if item.bind_processor(dialect) is None or isinstance(item, Boolean):
            return "binary array" if isinstance(item, _BINARY_ITEMS) else "array"
    return "processed"
