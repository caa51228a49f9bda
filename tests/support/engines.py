"""engines: SQLAlchemy engines on test databases, and the statements they send; never shared.

* `engine_for` opens an engine on a URL for the body of a ``with`` and disposes of it after.
* `statements_of` records every statement an engine sends from now on.
* `lose` ends the server process behind a connection, as a crash or an administrator would.
* `executions_of` records every time an engine has run one given statement object (one of
  ``sqlalchemy_pgtask.statements``, say) through the compiled path; the single enqueue's
  statements go to the driver as text and are never seen here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.sql.base import Executable

__all__ = ["engine_for", "executions_of", "lose", "statements_of", "terminate_backend"]


@contextlib.contextmanager
def engine_for(url: str, **options: Any) -> Iterator[Engine]:
    """An engine on ``url`` (``create_engine`` options as keywords), disposed of afterwards."""
    engine = create_engine(url, **options)
    try:
        yield engine
    finally:
        engine.dispose()


def statements_of(engine: Engine) -> list[str]:
    """A list that fills with the SQL text of every statement ``engine`` sends from now on."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    return seen


def executions_of(engine: Engine, statement: Executable) -> list[Any]:
    """A list that gets the parameters of each execution of ``statement`` (that very object,
    however it was compiled) once ``engine`` has run it, from now on."""
    seen: list[Any] = []

    def record(
        conn: Any, cursor: Any, text: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        compiled = getattr(context, "compiled", None)
        if compiled is not None and compiled.statement is statement:
            seen.append(parameters)

    event.listen(engine, "after_cursor_execute", record)
    return seen


def terminate_backend(engine: Engine, pid: int) -> None:
    """End the server process ``pid`` from a connection of ``engine``, once it has gone."""
    with engine.connect() as killer:
        ended = killer.execute(
            text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid}
        ).scalar_one()
    assert ended, f"backend {pid} did not end"


def lose(connection: Connection) -> None:
    """End ``connection``'s server process (outside a transaction); the client learns it
    at its next statement."""
    pid = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
    connection.commit()
    terminate_backend(connection.engine, pid)
