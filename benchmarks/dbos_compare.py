"""benchmarks/dbos_compare.py: DBOS Transact and this library's durable workflows side by side
on the same host: 5-step workflows and fan-out with result waits, alternated.

::

    python3 -m venv /tmp/dbos && /tmp/dbos/bin/pip install dbos
    .venv/bin/python benchmarks/dbos_compare.py --dbos-python /tmp/dbos/bin/python \\
        [--database-url URL] [--rounds 3] [--quick] [--poll 0.01] [--only workflows,fanout]

``benchmarks/compare.py`` runs this and ``pgqueuer_compare.py`` and prints the issue's whole
table. DBOS runs in its own interpreter (``--dbos-python``: it is no dependency of this
project), its system database a fresh database on the same server per measurement (created,
migrated by a ``DBOS.launch()``, filled by a ``DBOSClient``, dropped afterwards). Its worker is
one process (``DBOS.launch()``, sync ``@DBOS.workflow`` and ``@DBOS.step`` functions on its
thread pool), its queues polled every ``--poll`` seconds (10 ms; DBOS's default is 1 s):

* ``workflows``: 2,000 workflows enqueued beforehand on a queue with ``worker_concurrency``
  10, each five ``@DBOS.step`` calls returning a small integer; workflows/s from the first
  workflow's start to the last one's status update (the system database's
  ``started_at_epoch_ms`` and ``updated_at``). Ours: ``workflow.py --only workflow
  --concurrency 10`` (five ``ctx.step`` calls; first attempt start to last completion).
* ``fanout``: 20 parent workflows enqueued beforehand (a queue of their own, no limit: a DBOS
  parent blocked in ``get_result`` holds its thread, where ours is suspended without a slot),
  each enqueuing 100 child workflows on a queue with ``worker_concurrency`` 10 and then
  waiting for each child's result in turn (``handle.get_result``, polled every ``--poll``);
  children/s over the same window. Ours: ``workflow.py --only fanout --parents 20
  --children 100 --concurrency 10``.

Both give CPU per durable step (``workflows``) or per child (``fanout``): the worker process's
own (DBOS's counts itself, ``time.process_time``, from a start signal sent after its imports to
a stop signal sent once every workflow succeeded; ours, from ``/proc``, from its registration
to the drained queue) plus every ``postgres`` process's on this host over the same span
(``/proc``: other databases' load on the server is included on both sides alike).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psycopg
from _compare import (
    Figures,
    add_arguments,
    pair,
    run_ours,
    run_rounds,
    selected,
    stop,
    wait_until,
)
from _server import libpq_url, psycopg_url, server
from run import postgres_cpu

from sqlalchemy_pgtask.testing import create_database, drop_database

STEPS = 5

#: Run by ``--dbos-python`` as ``MODE URL ...``: ``install``; ``fill KIND COUNT CHILDREN``
#: (KIND ``flow`` or ``parent``); ``worker OUT READY GO CONCURRENCY POLL`` (READY once imported
#: and configured; launches at GO; at GO.stop writes its CPU seconds since GO to OUT and exits).
DBOS_SIDE = textwrap.dedent(
    """
    import json, os, sys, time

    from dbos import DBOS, DBOSClient, DBOSConfig

    mode, url, rest = sys.argv[1], sys.argv[2], sys.argv[3:]


    @DBOS.step()
    def step(i):
        return i


    @DBOS.workflow()
    def flow(n):
        total = 0
        for i in range(5):
            total += step(i)
        return total


    @DBOS.workflow()
    def child(i):
        return i


    @DBOS.workflow()
    def parent(p, children, poll):
        queue = DBOS.retrieve_queue("children")
        handles = [queue.enqueue(child, i) for i in range(children)]
        return sum(h.get_result(polling_interval_sec=poll) for h in handles)


    def configure():
        config: DBOSConfig = {"name": "bench", "system_database_url": url, "log_level": "WARNING",
                              "application_version": "bench"}
        DBOS(config=config)


    def wait_for(path):
        while not os.path.exists(path):
            time.sleep(0.005)


    if mode == "install":
        configure()
        DBOS.launch()
        DBOS.destroy()
    elif mode == "fill":
        kind, count, children, poll = rest[0], int(rest[1]), int(rest[2]), float(rest[3])
        client = DBOSClient(system_database_url=url)
        for n in range(count):
            if kind == "flow":
                client.enqueue({"queue_name": "work", "workflow_name": "flow"}, n)
            else:
                options = {"queue_name": "parents", "workflow_name": "parent"}
                client.enqueue(options, n, children, poll)
        client.destroy()
    else:
        out, ready, go, concurrency, poll = rest[0], rest[1], rest[2], int(rest[3]), float(rest[4])
        configure()
        open(ready, "w").close()
        wait_for(go)
        cpu0 = time.process_time()
        DBOS.launch()
        DBOS.register_queue("work", worker_concurrency=concurrency, polling_interval_sec=poll)
        DBOS.register_queue("children", worker_concurrency=concurrency, polling_interval_sec=poll)
        DBOS.register_queue("parents", polling_interval_sec=poll)
        wait_for(go + ".stop")
        with open(out, "w") as f:
            json.dump({"cpu_s": time.process_time() - cpu0}, f)
        DBOS.destroy()
    """
)


class Dbos:
    """One DBOS measurement: a fresh system database, filled, and one worker process."""

    def __init__(self, python: str, server_url: str, tmp: Path, poll: float) -> None:
        self.side = [python, "-c", DBOS_SIDE]
        self.server_url, self.tmp, self.poll = server_url, tmp, poll

    def run(self, kind: str, count: int, children: int, concurrency: int) -> Figures:
        raw = create_database(self.server_url, "dbos_compare")
        try:
            url = libpq_url(raw)
            subprocess_run([*self.side, "install", url])
            subprocess_run(
                [*self.side, "fill", url, kind, str(count), str(children), str(self.poll)]
            )
            total = count * (children + 1)
            cpu, seconds = self.work(url, total, concurrency)
        finally:
            drop_database(raw)
        if kind == "flow":
            return {"workflows_per_s": count / seconds,
                    "cpu_ms_per_step": cpu / (count * STEPS) * 1000}
        return {"children_per_s": count * children / seconds,
                "cpu_ms_per_child": cpu / (count * children) * 1000}

    def work(self, url: str, total: int, concurrency: int) -> tuple[float, float]:
        """(CPU seconds of the worker and the server, seconds of the window) for ``total``
        workflows that must all succeed."""
        out, ready, go = self.tmp / "dbos.json", self.tmp / "ready", self.tmp / "go"
        stop_file = Path(f"{go}.stop")
        for path in (out, ready, go, stop_file):
            path.unlink(missing_ok=True)
        worker = subprocess.Popen(
            [*self.side, "worker", url, str(out), str(ready), str(go), str(concurrency),
             str(self.poll)],
            stdout=subprocess.DEVNULL,
        )
        with psycopg.connect(url, autocommit=True) as conn:

            def succeeded() -> int:
                row = conn.execute(
                    "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'"
                ).fetchone()
                return int(row[0]) if row else 0

            try:
                wait_until(ready.exists, worker, 60, "the worker to start", peer="DBOS")
                server_cpu0 = postgres_cpu()
                go.touch()
                wait_until(lambda: succeeded() == total, worker, 60 + total / 20,
                           f"{total} workflows to succeed", interval=0.25, peer="DBOS")
                server_cpu = postgres_cpu() - server_cpu0
                stop_file.touch()
                wait_until(out.exists, worker, 30, "the worker's CPU", peer="DBOS")
            finally:
                stop(worker)
            row = conn.execute(
                "SELECT (max(updated_at) - min(started_at_epoch_ms)) / 1000.0"
                " FROM dbos.workflow_status"
            ).fetchone()
        if row is None or row[0] is None:
            raise RuntimeError("no finished workflow in dbos.workflow_status")
        worker_cpu = float(json_load(out)["cpu_s"])
        return worker_cpu + server_cpu, float(row[0])


def subprocess_run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"DBOS {command[3]} exited with {done.returncode}: "
                           f"{done.stderr[-2000:]}")


def json_load(path: Path) -> dict[str, float]:
    loaded: dict[str, float] = json.loads(path.read_text())
    return loaded


def ours(tmp: Path, url: str, workload: str, sizes: dict[str, int]) -> Figures:
    """``workload`` of ``workflow.py``, once, in its own throwaway database."""
    name = "workflow" if workload == "workflows" else "fanout"
    document = run_ours(
        "workflow.py",
        ["--database-url", url, "--only", name, "--repeat", "1", "--concurrency", "10",
         "--tasks", str(sizes["workflows"]), "--parents", str(sizes["parents"]),
         "--children", str(sizes["children"])],
        tmp / "workflow.json",
    )
    figures = document["runs"][0][name]
    if name == "workflow":
        return {"workflows_per_s": float(figures["tasks_per_second"]),
                "cpu_ms_per_step": float(figures["cpu_ms_per_task"]) / STEPS}
    children = sizes["parents"] * sizes["children"]
    return {"children_per_s": float(figures["children_per_second"]),
            "cpu_ms_per_child": float(figures["cpu_ms_per_task"]) * sizes["parents"] / children}


WORKLOADS = ("workflows", "fanout")


def sizes(quick: bool) -> dict[str, int]:
    """The counts: the issue's, or a smoke run's."""
    if quick:
        return {"workflows": 200, "parents": 4, "children": 50}
    return {"workflows": 2_000, "parents": 20, "children": 100}


def measure(
    peer: Dbos, url: str, workload: str, ours_first: bool, quick: bool
) -> tuple[Figures, Figures]:
    """(DBOS's, ours) figures for one round of ``workload``."""
    counts = sizes(quick)

    def theirs() -> Figures:
        if workload == "workflows":
            return peer.run("flow", counts["workflows"], 0, 10)
        return peer.run("parent", counts["parents"], counts["children"], 10)

    return pair(theirs, lambda: ours(peer.tmp, url, workload, counts), ours_first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dbos-python", required=True, metavar="PATH",
                        help="an interpreter with dbos installed")
    parser.add_argument("--poll", type=float, default=0.01, metavar="SECONDS",
                        help="DBOS's queue polling interval (0.01)")
    add_arguments(parser, WORKLOADS)
    args = parser.parse_args(argv)
    names = selected(parser, args, WORKLOADS)
    with server(args.database_url) as found, tempfile.TemporaryDirectory() as tmp:
        url = psycopg_url(found.url)
        peer = Dbos(args.dbos_python, url, Path(tmp), args.poll)
        run_rounds(names, args.rounds, "dbos",
                   lambda workload, first: measure(peer, url, workload, first, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
