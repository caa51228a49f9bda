"""_driver_sql: hot statements sent to psycopg as text compiled once; no I/O of its own.

`Connection.execute` of a construct looks up its compiled form and processes every parameter
on each execution: for a single enqueue, much of SQLAlchemy's cost per statement. A statement
whose parameters are all the caller's and need no conversion can go to the driver as the same
text with `Connection.exec_driver_sql` instead, which still fires the cursor events, echoes,
wraps errors, begins the transaction and invalidates a lost connection.
"""

from __future__ import annotations

import weakref
from typing import Final

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.base import Executable

__all__ = ["driver_sql"]


def driver_sql(connection: Connection | AsyncConnection, statement: Executable) -> str | None:
    """``statement`` compiled once for ``connection``'s driver, or None where that is unsafe.

    Only for psycopg (its named ``pyformat`` parameters take the same dictionary) and for
    statements whose every parameter is the caller's and needs no conversion on the way; never
    under a ``schema_translate_map``, which only compilation applies, nor on a connection with
    ``before_execute`` or ``after_execute`` listeners, which `exec_driver_sql` skips.
    """
    sync = connection.sync_connection if isinstance(connection, AsyncConnection) else connection
    if sync is None:
        return None
    dialect = sync.dialect
    if (
        dialect.driver != "psycopg"
        or sync.get_execution_options().get("schema_translate_map")
        # A caller listening to these two events keeps seeing every enqueue.
        or sync.dispatch.before_execute
        or sync.dispatch.after_execute
    ):
        return None
    by_statement = _DRIVER_SQL.get(dialect)
    if by_statement is None:
        by_statement = _DRIVER_SQL[dialect] = {}
    try:
        return by_statement[statement]
    except KeyError:
        text = by_statement[statement] = _compiled_for_driver(statement, dialect)
        return text


#: `driver_sql`'s texts per dialect (one per engine) and statement; None: not safe to send so.
_DRIVER_SQL: Final[weakref.WeakKeyDictionary[Dialect, dict[Executable, str | None]]] = (
    weakref.WeakKeyDictionary()
)


def _compiled_for_driver(statement: Executable, dialect: Dialect) -> str | None:
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
    for bind in compiled.binds.values():
        if (
            # A literal in the construct (``state="running"``) compiles to a parameter of its
            # own, whose value only the compiled path supplies.
            not bind.required
            or bind.expanding
            or bind.literal_execute
            or bind.callable is not None
            or bind.type.dialect_impl(dialect).bind_processor(dialect) is not None
        ):
            return None
    return str(compiled.string)
