"""worker._session: the startup checks of the worker's database: the schema is installed, and
the worker's sessions are its own (no transaction pooler between them and PostgreSQL).

A worker relies on session state: `LISTEN` (woken on enqueue), session-level advisory locks
(instant rescue's sign of life), session settings (timeouts, planner) and psycopg's prepared
statements. Behind a transaction-mode pooler (PgBouncer ``pool_mode = transaction``) each
transaction may run on another server connection: notifications are lost in silence, a live
worker looks dead to its peers, and prepared statements fail or, worse, bind to another
client's. So a worker refuses to start there, in one line naming the fix.

The check: connection A runs ``pg_backend_pid()`` outside a transaction; connection B then
opens a transaction and asks the same. On a connection of its own, B's server process cannot
be A's while A is open; behind a transaction pooler, A's server connection went back to the
pool and B is usually handed that very one (PgBouncer reuses the most recent). If B got
another one, A asks again while B holds its own: behind a pooler, A may now run elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Final

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sqlalchemy_pgtask import statements
from sqlalchemy_pgtask._asyncio import bounded
from sqlalchemy_pgtask.errors import InvalidOptionError, SchemaNotInstalled

__all__ = ["POOLED_SESSION", "check_database"]

logger = logging.getLogger("sqlalchemy_pgtask.worker")

#: The worker's refusal behind a transaction pooler (the backend pids are appended).
POOLED_SESSION: Final = (
    "the worker's connections go through a transaction pooler (two statements of one "
    "connection ran in different server sessions), where LISTEN, advisory locks and "
    "prepared statements do not hold: give the worker a direct URL, or a session-mode pool "
    "(PgBouncer pool_mode = session)"
)
#: How long the second connection may take (an application's engine may have no spare one).
_SECOND_CONNECTION_TIMEOUT: Final = 10.0

_PID: Final = select(func.pg_backend_pid())


async def _close(connection: AsyncConnection) -> None:
    await connection.close()


async def _pid(connection: AsyncConnection) -> int:
    pid: int = (await connection.execute(_PID)).scalar_one()
    return pid


async def check_database(engine: AsyncEngine) -> None:
    """Raise unless the schema is installed and the worker's sessions are its own.

    :raises SchemaNotInstalled: the pgtask schema is missing.
    :raises InvalidOptionError: (``database``) a transaction pooler is in the way.
    """
    async with engine.connect() as first:
        installed = (await first.execute(statements.SCHEMA_INSTALLED)).scalar_one()
        if not installed:
            raise SchemaNotInstalled()
        await first.rollback()
        own = await first.execution_options(isolation_level="AUTOCOMMIT")
        before = await _pid(own)
        try:
            second = await bounded(
                engine.connect(), _SECOND_CONNECTION_TIMEOUT, discard=_close
            )
        except TimeoutError:
            logger.warning("no second connection within %.0f s: the check for a transaction "
                           "pooler was skipped", _SECOND_CONNECTION_TIMEOUT)
            return
        try:
            other = await _pid(second)  # inside a transaction: B holds its server connection
            after = before if other == before else await _pid(own)
        finally:
            with contextlib.suppress(Exception):
                await second.close()  # rolls B's transaction back
        if other != before and after == before:
            return
        raise InvalidOptionError(
            "database", f"{POOLED_SESSION}; backends {before}, {other}, {after}"
        )
