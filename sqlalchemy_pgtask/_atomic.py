"""_atomic: an administrative change and its audit entry commit together on every bind.

The admin functions write a change and its audit entry in several statements, in the caller's
transaction. On an AUTOCOMMIT connection there is no such transaction: each statement would
commit on its own, so a failure between them (the audit INSERT refused, the connection lost)
would leave a change without its entry. `audited_unit` gives such a call a transaction of its
own, begun and committed on the server, so the call is one unit there too; with a caller's
transaction it adds nothing (the caller commits, or not, both together).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import Connection

from sqlalchemy_pgtask._connection import translated_errors

__all__ = ["audited_unit", "is_autocommit"]


def is_autocommit(connection: Connection) -> bool:
    """Whether each statement on ``connection`` would commit on its own: its driver is in
    autocommit and the server has no transaction open (no SQL: the driver's own state)."""
    # The driver's own flag, not SQLAlchemy's options: it holds whichever way AUTOCOMMIT was
    # asked for (engine, connection or execution options, or a raw driver setting).
    if not getattr(connection.connection.dbapi_connection, "autocommit", False):
        return False
    # A caller who ran BEGIN on an autocommit connection has a transaction: the call joins it,
    # rather than committing it early with a COMMIT of its own.
    driver = connection.connection.driver_connection
    status = getattr(getattr(driver, "info", None), "transaction_status", None)
    if status is not None:  # psycopg (3 and 2): 0 is IDLE, no transaction open
        return int(status) == 0
    in_transaction = getattr(driver, "is_in_transaction", None)  # asyncpg
    return not (callable(in_transaction) and in_transaction())


@contextlib.contextmanager
def audited_unit(connection: Connection) -> Iterator[None]:
    """Run the body's statements as one transaction, even on an AUTOCOMMIT connection."""
    if not is_autocommit(connection):
        yield
        return
    with translated_errors(connection):
        connection.exec_driver_sql("BEGIN")
    try:
        yield
    except BaseException:
        # The body's own error is the one to report; a connection too broken to roll back
        # ends the server's transaction anyway.
        with contextlib.suppress(Exception), translated_errors(connection):
            connection.exec_driver_sql("ROLLBACK")
        raise
    with translated_errors(connection):
        connection.exec_driver_sql("COMMIT")
