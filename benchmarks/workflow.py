"""benchmarks/workflow.py: what a durable step costs, against a plain task.

One command::

    .venv/bin/python benchmarks/workflow.py [--database-url URL] [--tasks N] [--concurrency C]
                                            [--repeat K] [--only plain,workflow,fanout]

Like ``benchmarks/run.py`` it creates a throwaway database (``--database-url``, else the server
``benchmarks/_server.py`` finds) and drops it afterwards. Each
repeat runs two drains of ``N`` pre-enqueued tasks (default 2,000) by one ``pgtask worker``
subprocess at concurrency ``C`` (default 50):

* ``plain``: an ``async def`` handler that returns at once;
* ``workflow``: an ``async def`` handler that runs five ``ctx.step`` calls (each returns a
  small JSON value) and returns.

``--only fanout`` (or with the others) adds ``fanout``: ``--parents`` tasks (20) that each
spawn ``--children`` children (100), one ``ctx.spawn`` each, then wait for every child's result
in turn (``ctx.wait_for_result``: a parent whose child has not ended is suspended, without a
slot, until it has); children per second over the same window, all tasks included.

For each it reports tasks per second (database times: first attempt start to last
completion), the SQL statements the worker sent per task (counted with a SQLAlchemy
``before_cursor_execute`` hook in the worker process), among them the checkpoint writes, and
the transactions they ran (each statement on an autocommit connection, or one explicit
transaction), and CPU per task: the worker process's and every ``postgres`` process's on the
host (``/proc``), from the worker's registration to the drained queue. The per-step figures
are the workflow's minus the plain task's, divided by five. The target: one step costs at
most one extra statement round trip and no extra transaction beyond its checkpoint.

A workflow's tasks finish one by one as their steps complete, so its claims and outcome
writes batch less than a plain drain's: part of the per-step difference is that, not the
steps' own statements (reported separately as checkpoint statements per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench_run  # noqa: E402 - the sibling script's helpers
from _server import libpq_url, psycopg_url  # noqa: E402
from _server import server as bench_server  # noqa: E402

from sqlalchemy_pgtask.migrations import upgrade  # noqa: E402
from sqlalchemy_pgtask.testing import create_database, drop_database  # noqa: E402

STEPS = 5
TASKS_SOURCE = textwrap.dedent(
    '''
    """Handlers for benchmarks/workflow.py (written to a temporary directory)."""

    import atexit
    import os

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from sqlalchemy_pgtask import Registry, statements

    registry = Registry()
    _statements = [0]
    _checkpoints = [0]
    _transactions = [0]
    _count_path = os.environ.get("PGTASK_BENCH_STATEMENTS")
    if _count_path:

        @event.listens_for(Engine, "before_cursor_execute")
        def _count(conn, cursor, statement, parameters, context, executemany):
            _statements[0] += 1
            compiled = getattr(context, "compiled", None)
            if compiled is not None and compiled.statement is statements.SAVE_CHECKPOINT:
                _checkpoints[0] += 1
            # Transactions: each statement of an autocommit connection is one, except inside
            # an explicit BEGIN ... COMMIT; other connections count at their commit.
            if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
                return
            if statement.startswith("BEGIN"):
                conn.info["pgtask_bench_in_tx"] = True
            elif statement == "COMMIT":
                conn.info["pgtask_bench_in_tx"] = False
                _transactions[0] += 1
            elif not conn.info.get("pgtask_bench_in_tx"):
                _transactions[0] += 1

        @event.listens_for(Engine, "commit")
        def _commit(conn):
            _transactions[0] += 1

        def _write():
            with open(_count_path, "w") as out:
                out.write(f"{_statements[0]} {_checkpoints[0]} {_transactions[0]}")

        atexit.register(_write)


    @registry.task("plain")
    async def plain(ctx, payload):
        return None


    @registry.task("workflow")
    async def workflow(ctx, payload):
        total = 0
        for i in range(5):
            total += await ctx.step(f"step-{i}", lambda i=i: i)
        return total


    @registry.task("fanout")
    async def fanout(ctx, payload):
        children = [
            await ctx.spawn(f"spawn-{i}", "child", {"i": i}) for i in range(payload["children"])
        ]
        total = 0
        for i, child in enumerate(children):
            total += (await ctx.wait_for_result(f"wait-{i}", child)).result
        return total


    @registry.task("child")
    async def child(ctx, payload):
        return payload["i"]
    '''
)


def drain(
    bench: bench_run.Bench, name: str, tasks: int, concurrency: int, children: int = 0
) -> dict[str, Any]:
    """``tasks`` pre-enqueued ``name`` tasks (each a ``fanout`` of ``children``) drained by one
    worker; per task, and the CPU of the worker and of every ``postgres`` process meanwhile."""
    bench_run.reset(bench)
    bench_run.preload(bench, tasks, name, lambda i: {"i": i, "children": children})
    counts = bench.tasks_dir / f"{name}.r{bench.repeat_index}.statements"
    counts.unlink(missing_ok=True)
    os.environ["PGTASK_BENCH_STATEMENTS"] = str(counts)
    try:
        with psycopg.connect(bench.conninfo, autocommit=True) as conn:
            started = time.monotonic()
            with bench_run.worker_process(bench, concurrency, name) as proc:
                bench_run.wait_until(
                    lambda: bench_run.registered(conn, proc.pid), started + 60, proc,
                    f"{name} to register", interval=0.005,
                )
                worker_cpu0 = bench_run.process_cpu(proc.pid)
                server_cpu0 = bench_run.postgres_cpu()
                bench_run.wait_until(
                    lambda: bench_run.outstanding(conn) == 0,
                    started + 60 + tasks * (children + 1) / 20, proc,
                    f"{name} to drain {tasks} tasks", interval=0.25,
                )
                worker_cpu = bench_run.process_cpu(proc.pid) - worker_cpu0
                server_cpu = bench_run.postgres_cpu() - server_cpu0
            succeeded, seconds = bench_run.drained_window(conn)
    finally:
        del os.environ["PGTASK_BENCH_STATEMENTS"]
    if succeeded != tasks * (children + 1):
        raise RuntimeError(f"{name}: {succeeded} of {tasks} succeeded\n"
                           f"{bench_run.log_tail(bench, name)}")
    statements, checkpoints, transactions = (int(n) for n in counts.read_text().split())

    return {
        "tasks_per_second": tasks / seconds,
        "seconds": seconds,
        "statements_per_task": statements / tasks,
        "checkpoint_statements_per_task": checkpoints / tasks,
        "transactions_per_task": transactions / tasks,
        "worker_cpu_ms_per_task": worker_cpu / tasks * 1000,
        "server_cpu_ms_per_task": server_cpu / tasks * 1000,
        "cpu_ms_per_task": (worker_cpu + server_cpu) / tasks * 1000,
        **({"children_per_second": tasks * children / seconds} if children else {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", metavar="URL")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "workflow-results.json")
    parser.add_argument("--only", default="plain,workflow", metavar="NAMES",
                        help="comma-separated, of plain, workflow, fanout (plain,workflow)")
    parser.add_argument("--parents", type=int, default=20, help="fanout's parents (20)")
    parser.add_argument("--children", type=int, default=100,
                        help="fanout's children per parent (100)")
    args = parser.parse_args(argv)
    selected = [name.strip() for name in args.only.split(",")]
    if unknown := set(selected) - {"plain", "workflow", "fanout"}:
        parser.error(f"unknown workload(s): {', '.join(sorted(unknown))}")

    def measure(server_url: str) -> list[dict[str, dict[str, Any]]]:
        database = create_database(psycopg_url(server_url), "pgtask_bench_wf")
        engine = create_engine(database)
        runs = []
        try:
            upgrade(database)
            with tempfile.TemporaryDirectory(prefix="pgtask-bench-wf-") as tmp:
                tasks_dir = Path(tmp)
                (tasks_dir / f"{bench_run.TASKS_MODULE}.py").write_text(TASKS_SOURCE)
                config = bench_run.Config(
                    single=0, many=0, many_batch=1, drain=args.tasks, latency=0,
                    latency_gap=0.0, warmup=0,
                )
                for index in range(args.repeat):
                    bench = bench_run.Bench(
                        url=database, conninfo=libpq_url(database), engine=engine,
                        tasks_dir=tasks_dir, config=config, py_spy=None, cprofile=None,
                        loop="auto", repeat_index=index, horizon_wait=60.0,
                    )
                    figures = {}
                    for name in selected:
                        print(f"[repeat {index + 1}/{args.repeat}] {name} ...", file=sys.stderr,
                              flush=True)
                        figures[name] = (
                            drain(bench, name, args.parents, args.concurrency, args.children)
                            if name == "fanout" else
                            drain(bench, name, args.tasks, args.concurrency)
                        )
                    runs.append(figures)
        finally:
            engine.dispose()
            drop_database(database)
        return runs

    with bench_server(args.database_url) as found:
        runs = measure(found.url)
        server = found.description

    document: dict[str, Any] = {"runs": runs}
    if "fanout" in selected:
        rates = [run["fanout"]["children_per_second"] for run in runs]
        print(f"fan-out: {args.parents} parents x {args.children} children: "
              f"{statistics.median(rates):8.0f} children/s")
    if {"plain", "workflow"} <= set(selected):
        document["summary"] = step_summary(runs, args, server)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def step_summary(
    runs: list[dict[str, dict[str, Any]]], args: argparse.Namespace, server: str
) -> dict[str, Any]:
    """A step's cost: the workflow's figures against the plain task's (printed, returned)."""

    def median(name: str, key: str) -> float:
        return float(statistics.median(run[name][key] for run in runs))

    per_step = []
    for run in runs:
        plain, flow = run["plain"], run["workflow"]
        per_step.append({
            "extra_ms": (1 / flow["tasks_per_second"] - 1 / plain["tasks_per_second"])
            * 1000 / STEPS,
            "extra_statements": (flow["statements_per_task"] - plain["statements_per_task"])
            / STEPS,
            "extra_transactions": (
                flow["transactions_per_task"] - plain["transactions_per_task"]
            ) / STEPS,
        })
    summary = {
        "tasks": args.tasks, "concurrency": args.concurrency, "repeats": args.repeat,
        "server": server,
        "plain_tasks_per_second": median("plain", "tasks_per_second"),
        "workflows_per_second": median("workflow", "tasks_per_second"),
        "plain_statements_per_task": median("plain", "statements_per_task"),
        "workflow_statements_per_task": median("workflow", "statements_per_task"),
        "plain_transactions_per_task": median("plain", "transactions_per_task"),
        "workflow_transactions_per_task": median("workflow", "transactions_per_task"),
        "checkpoint_statements_per_step": median("workflow", "checkpoint_statements_per_task")
        / STEPS,
        "per_step_extra_ms": statistics.median(s["extra_ms"] for s in per_step),
        "per_step_extra_statements": statistics.median(s["extra_statements"] for s in per_step),
        "per_step_extra_transactions": statistics.median(s["extra_transactions"] for s in per_step),
    }
    print(f"plain tasks:  {summary['plain_tasks_per_second']:8.0f} /s   "
          f"{summary['plain_statements_per_task']:.2f} statements, "
          f"{summary['plain_transactions_per_task']:.2f} transactions per task")
    print(f"5-step flows: {summary['workflows_per_second']:8.0f} /s   "
          f"{summary['workflow_statements_per_task']:.2f} statements, "
          f"{summary['workflow_transactions_per_task']:.2f} transactions per task")
    print(f"one step: {summary['checkpoint_statements_per_step']:.2f} checkpoint statements; "
          f"in all +{summary['per_step_extra_statements']:.2f} statements, "
          f"+{summary['per_step_extra_transactions']:.2f} transactions, "
          f"+{summary['per_step_extra_ms']:.3f} ms of drain time")
    return summary


if __name__ == "__main__":
    sys.exit(main())
