"""durable_app: a durable workflow that real ``pgtask worker`` processes run, for crash tests.

* `write_durable_app` writes ``durable_app.py`` into a directory; the worker imports it from its
  working directory as ``durable_app:registry`` (`DurableLauncher` starts such workers).
* `create_durable_tables` creates the side tables the handlers write into, in the test's
  database: ``durable_runs`` (one row per execution of a body whose runs are counted),
  ``durable_marks`` (one row each time a handler passes a *point*) and ``durable_orders`` (the
  business rows the workflow's fenced transaction writes).

The workflow (``durable-order``) makes every kind of durable call once, and passes a named
point right after each (and one inside its first step's body, before that step's checkpoint):

====================  =====================================================================
point                 where the handler is
====================  =====================================================================
``charging``          inside step ``charge``'s body, after it recorded its run, before the
                      step's checkpoint (the documented at-least-once window)
``charged``           step ``charge`` checkpointed
``recorded``          the fenced transaction ``record-order`` committed its business row
``rested``            past the durable sleep ``nap``
``approved``          past the wait for signal ``approval``
``spawned``           child ``ship`` spawned (its id checkpointed)
``shipped``           past the wait for the child's result
``shipping``          (in the child) the child recorded its run
====================  =====================================================================

At a point the handler records a row in ``durable_marks`` (task, point, attempt, pid) through a
connection of its own, committed at once; if the payload's ``hold`` names the point, it then
waits until the file ``release-<point>`` exists in the working directory (`release`). A test
reads the mark, knows the handler sits right after (or inside) that durable call with
everything before committed, and kills the worker there with SIGKILL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from tests.support.workerproc import (
    Database,
    WorkerLauncher,
)

__all__ = [
    "CHILD",
    "CHILD_MAX_ATTEMPTS",
    "MARKS_TABLE",
    "ORDERS_TABLE",
    "RUNS_TABLE",
    "TARGET",
    "WORKFLOW",
    "WORKFLOW_MAX_ATTEMPTS",
    "DurableLauncher",
    "create_durable_tables",
    "release",
    "write_durable_app",
]

#: What ``pgtask worker`` loads.
TARGET: Final = "durable_app:registry"
#: The workflow and its child task.
WORKFLOW: Final = "durable-order"
CHILD: Final = "durable-ship"
#: Attempt budgets (failed attempts, lost ones included; suspensions never count).
WORKFLOW_MAX_ATTEMPTS: Final = 5
CHILD_MAX_ATTEMPTS: Final = 4

RUNS_TABLE: Final = "durable_runs"
MARKS_TABLE: Final = "durable_marks"
ORDERS_TABLE: Final = "durable_orders"

_DURABLE_APP = '''\
"""durable_app: the durable workflow of pgtask's crash tests (tests/support/durable_app.py).

Payload of durable-order: ``order`` (an int), ``nap`` (seconds of durable sleep), ``hold`` (the
points to wait at until the file release-<point> exists). The child gets ``order`` and ``hold``.
"""

import asyncio
import os
from pathlib import Path

import psycopg
from sqlalchemy import text

from sqlalchemy_pgtask import Registry, RetryPolicy

registry = Registry()

RECORD_URL = os.environ.get("ACCEPTANCE_RECORD_URL", "")
#: An unexpected exception fails the task at once (the test then says so instead of timing
#: out); lost attempts are recovered by max_attempts alone.
NEVER = RetryPolicy.never()

_RAN = "INSERT INTO durable_runs (task_id, body, attempt, pid) VALUES (%s, %s, %s, %s)"
_MARK = "INSERT INTO durable_marks (task_id, point, attempt, pid) VALUES (%s, %s, %s, %s)"
_ORDER = "INSERT INTO durable_orders (task_id, attempt) VALUES (:task, :attempt) RETURNING id"


async def _record(statement, params):
    """One committed row, on a connection of its own: it survives a kill of the worker."""
    conn = await psycopg.AsyncConnection.connect(RECORD_URL, autocommit=True)
    async with conn:
        await conn.execute(statement, params)


async def ran(ctx, body):
    await _record(_RAN, (ctx.task_id, body, ctx.attempt, os.getpid()))


async def point(ctx, payload, name):
    """Record that this attempt got here; wait for release-<name> if the payload says so."""
    await _record(_MARK, (ctx.task_id, name, ctx.attempt, os.getpid()))
    if name in payload.get("hold", ()):
        release = Path(f"release-{name}")
        while not release.exists():
            await asyncio.sleep(0.02)


@registry.task("{child}", retry=NEVER, max_attempts={child_max_attempts})
async def ship(ctx, payload):
    await ran(ctx, "ship")
    await point(ctx, payload, "shipping")
    return {"tracking": f"T-{payload['order']}", "attempt": ctx.attempt}


@registry.task("{workflow}", retry=NEVER, max_attempts={workflow_max_attempts})
async def order(ctx, payload):
    async def charge():
        await ran(ctx, "charge")
        await point(ctx, payload, "charging")
        return {"charged": payload["order"], "attempt": ctx.attempt}

    charged = await ctx.step("charge", charge)
    await point(ctx, payload, "charged")

    tx = ctx.transaction("record-order")
    async with tx as session:
        inserted = await session.execute(
            text(_ORDER), {"task": ctx.task_id, "attempt": ctx.attempt}
        )
        tx.result = {"order_id": inserted.scalar_one(), "attempt": ctx.attempt}
    await point(ctx, payload, "recorded")

    await ctx.sleep_for("nap", payload.get("nap", 0))
    await point(ctx, payload, "rested")

    approval = await ctx.wait_for_signal("await-approval", "approval")
    await point(ctx, payload, "approved")

    child = await ctx.spawn(
        "ship", ship, {"order": payload["order"], "hold": payload.get("hold", [])}
    )
    await point(ctx, payload, "spawned")

    shipped = await ctx.wait_for_result("await-shipment", child)
    await point(ctx, payload, "shipped")
    return {
        "charge": charged,
        "order": tx.result,
        "approval": approval,
        "child": str(child),
        "shipment": {"state": shipped.state, "result": shipped.result},
        "attempt": ctx.attempt,
    }
'''


def write_durable_app(directory: Path) -> Path:
    """Write ``durable_app.py`` into ``directory`` and return its path."""
    path = directory / "durable_app.py"
    source = (
        _DURABLE_APP.replace("{workflow}", WORKFLOW)
        .replace("{child}", CHILD)
        .replace("{workflow_max_attempts}", str(WORKFLOW_MAX_ATTEMPTS))
        .replace("{child_max_attempts}", str(CHILD_MAX_ATTEMPTS))
    )
    path.write_text(source)
    return path


def create_durable_tables(database: Database) -> None:
    """The side tables of ``durable_app`` (no unique keys: duplicates are what tests count)."""
    database.execute(
        f"""
        CREATE TABLE {RUNS_TABLE} (
            task_id uuid NOT NULL,
            body text NOT NULL,
            attempt integer NOT NULL,
            pid integer NOT NULL,
            at timestamptz NOT NULL DEFAULT clock_timestamp()
        )
        """
    )
    database.execute(
        f"""
        CREATE TABLE {MARKS_TABLE} (
            task_id uuid NOT NULL,
            point text NOT NULL,
            attempt integer NOT NULL,
            pid integer NOT NULL,
            at timestamptz NOT NULL DEFAULT clock_timestamp()
        )
        """
    )
    database.execute(
        f"""
        CREATE TABLE {ORDERS_TABLE} (
            id serial PRIMARY KEY,
            task_id uuid NOT NULL,
            attempt integer NOT NULL
        )
        """
    )


def release(directory: Path, point: str) -> None:
    """Let handlers held at ``point`` go on (and pass it without waiting from now on)."""
    (directory / f"release-{point}").touch()


class DurableLauncher(WorkerLauncher):
    """`WorkerLauncher` for ``pgtask worker durable_app:registry``; same lifetime guarantees."""

    def __init__(self, directory: Path, database: Database) -> None:
        super().__init__(directory, database, TARGET)

