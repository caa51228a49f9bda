"""benchmarks/cascade.py: what a cascading cancellation costs, by the depth and size of the tree.

One command (run on demand; it is not a test)::

    .venv/bin/python benchmarks/cascade.py [--database-url URL] [--revision REV]
                                           [--chains 1000,4000,10000] [--trees 10000,100000]
                                           [--timeout S]

It creates a throwaway database (``--database-url``, else the server that
``benchmarks/_server.py`` finds) migrated to ``--revision`` (default: the head; give
``pgtask_0012`` for the per-row cascade before ``pgtask_0013``), and for each shape (a chain
of n tasks, each the only child of the one above; a complete 10-ary tree of n tasks) below a
fresh task times three statements, each the only one in its transaction:

* ``cancel root``: ``cancel()`` of the task above the shape;
* ``complete parent``: the worker's ``COMPLETE`` of that task, running;
* ``wait timeout``: the worker's ``WAIT_TIMEOUTS`` for a parent whose child-result wait on
  the shape's top task is due.

Each statement runs under ``statement_timeout = --timeout`` (default 120 s); one cut short
prints as ``> S``. The shapes are inserted with one ``INSERT ... SELECT`` (not timed).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
from collections.abc import Callable

from _server import scratch_database
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.exc import OperationalError

from sqlalchemy_pgtask import cancel, enqueue
from sqlalchemy_pgtask import statements as st
from sqlalchemy_pgtask.migrations import HEAD
from sqlalchemy_pgtask.retry import RetryPolicy

WORKER = uuid.UUID("00000000-0000-4000-8000-00000000cafe")


def shape(conn: Connection, head: uuid.UUID, kind: str, size: int) -> None:
    """``size`` pending tasks below ``head``: a chain, or a complete 10-ary tree."""
    parent = (
        "CASE WHEN i = 1 THEN :head ELSE md5(:seed || (i - 1))::uuid END" if kind == "chain"
        else "CASE WHEN i <= 10 THEN :head ELSE md5(:seed || ((i - 1) / 10))::uuid END"
    )
    children = "i < :n" if kind == "chain" else "i * 10 + 1 <= :n"
    conn.execute(
        text(
            "INSERT INTO pgtask.tasks (id, queue, name, payload, parent_id, has_children)"
            f" SELECT md5(:seed || i)::uuid, 'default', 'leaf', '{{}}'::jsonb, {parent},"
            f" {children} FROM generate_series(1, :n) AS i"
        ),
        {"seed": uuid.uuid4().hex, "head": head, "n": size},
    )
    conn.execute(text("UPDATE pgtask.tasks SET has_children = true WHERE id = :id"), {"id": head})


def running(conn: Connection, name: str) -> st.Lease:
    enqueue(conn, name, None)
    capabilities = st.capability_params(
        ["default"], [st.Capability("default", name, 1, RetryPolicy.fixed(1.0), 5)]
    )
    bound = st.claim_params(capabilities, worker_id=WORKER, lease_seconds=600.0, limit=1)
    [row] = conn.execute(st.CLAIM, bound).all()
    return st.Lease(row.id, row.attempt, row.lease_token)


def setup_cancel(conn: Connection, kind: str, size: int) -> Callable[[], object]:
    root = enqueue(conn, "root", None).id
    shape(conn, root, kind, size)
    return lambda: cancel(conn, root)


def setup_complete(conn: Connection, kind: str, size: int) -> Callable[[], object]:
    lease = running(conn, "parent")
    shape(conn, lease.task_id, kind, size)
    bound = st.complete_params([lease], [json.dumps("done")])
    return lambda: conn.execute(st.COMPLETE, bound).all()


def setup_timeout(conn: Connection, kind: str, size: int) -> Callable[[], object]:
    # The wait as REGISTER_RESULT_WAIT leaves it (the parent waiting, its lease released),
    # written directly: only the timeout pass is timed.
    parent = enqueue(conn, "parent", None).id
    child = uuid.uuid4()
    bound = {"parent": parent, "child": child}
    for statement in (
        "INSERT INTO pgtask.tasks (id, queue, name, payload, parent_id)"
        " VALUES (:child, 'default', 'child', '{}'::jsonb, :parent)",
        "UPDATE pgtask.tasks SET state = 'waiting', has_children = true WHERE id = :parent",
        "INSERT INTO pgtask.waits (task_id, kind, version, step, occurrence, child_id,"
        " timeout_at) VALUES (:parent, 'child', 1, 'await', 0, :child,"
        " pgtask.now() - interval '1 s')",
    ):
        conn.execute(text(statement), bound)
    shape(conn, child, kind, size - 1)

    def time_out() -> object:
        rows = conn.execute(st.WAIT_TIMEOUTS, {"limit": 100}).all()
        if [tuple(row)[:1] for row in rows] != [(parent,)] or getattr(rows[0], "held", False):
            raise RuntimeError(f"the wait was not timed out: {rows}")
        return rows

    return time_out


OPERATIONS = {
    "cancel root": setup_cancel, "complete parent": setup_complete, "wait timeout": setup_timeout,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--revision", default=HEAD)
    parser.add_argument("--chains", default="1000,4000,10000")
    parser.add_argument("--trees", default="10000,100000")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    shapes = [("chain", int(n)) for n in args.chains.split(",") if n] + [
        ("tree", int(n)) for n in args.trees.split(",") if n
    ]
    print(f"host: {platform.node()} ({platform.machine()}, {platform.system()}), "
          f"revision {args.revision}", flush=True)
    with scratch_database(args.database_url, "pgtask_bench_cascade", args.revision) as url:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
            print(f"PostgreSQL {version}", flush=True)
            print(f"{'shape':>14} | " + " | ".join(f"{op:>15}" for op in OPERATIONS))
            for kind, size in shapes:
                cells = []
                for setup in OPERATIONS.values():
                    run = setup(conn, kind, size)
                    conn.execute(text(f"SET statement_timeout = '{int(args.timeout * 1000)}ms'"))
                    started = time.perf_counter()
                    try:
                        run()
                        cells.append(f"{time.perf_counter() - started:>14.3f}s")
                    except OperationalError:
                        cells.append(f"{'> ' + format(args.timeout, 'g'):>14}s")
                    conn.execute(text("RESET statement_timeout"))
                    conn.execute(text("DELETE FROM pgtask.tasks"))
                print(f"{kind + ' ' + format(size, ','):>14} | " + " | ".join(cells), flush=True)
        engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
