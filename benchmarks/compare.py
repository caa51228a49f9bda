"""benchmarks/compare.py: the performance issue's whole table, measured on this host: every
row as ours / theirs, both figures and the ratio, medians of alternated rounds.

::

    python3 -m venv /tmp/pgq && /tmp/pgq/bin/pip install "pgqueuer==1.6.0" asyncpg uvloop
    python3 -m venv /tmp/dbos && /tmp/dbos/bin/pip install dbos
    .venv/bin/python benchmarks/compare.py --pgqueuer-python /tmp/pgq/bin/python \\
        --dbos-python /tmp/dbos/bin/python [--database-url URL] [--rounds 3] [--quick] \\
        [--poll 0.01] [--json PATH]

The queue rows are ``pgqueuer_compare.py``'s workloads (PgQueuer 1.6 on asyncpg and uvloop),
the durable rows ``dbos_compare.py``'s (DBOS Transact, its queues polled every ``--poll``
seconds); their docstrings say how each side is timed. Each round runs every workload once on
each side, the side that goes first alternating from round to round; the table shows the
medians over the rounds (3; ``--quick``: one round of smaller counts, a smoke run whose
figures are not the issue's). A ratio is ours / theirs: for a rate higher is better, for a
latency or a CPU cost lower is better (the "better" column says which).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import dbos_compare
import pgqueuer_compare
from _compare import Figures, add_arguments, fmt, medians, selected
from _server import psycopg_url, server


class Row(NamedTuple):
    label: str
    peer: str  # "pgqueuer" or "dbos"
    workload: str
    figure: str
    higher_is_better: bool
    unit: str


ROWS = (
    Row("single enqueue, a Session per task in its own transaction", "pgqueuer",
        "enqueue_session", "tasks_per_s", True, "tasks/s"),
    Row("`enqueue_many` of 1,000", "pgqueuer", "enqueue_many", "tasks_per_s", True, "tasks/s"),
    Row("enqueue -> handler start latency p50", "pgqueuer", "latency", "p50_ms", False, "ms"),
    Row("enqueue -> handler start latency p99", "pgqueuer", "latency", "p99_ms", False, "ms"),
    Row("drain 20,000 no-op tasks, concurrency 10", "pgqueuer", "drain_c10", "tasks_per_s",
        True, "tasks/s"),
    Row("drain, concurrency 100", "pgqueuer", "drain_c100", "tasks_per_s", True, "tasks/s"),
    Row("CPU per task at concurrency 10 (worker + backends)", "pgqueuer", "drain_c10",
        "cpu_ms_per_task", False, "ms"),
    Row("2,000 workflows of 5 durable steps, concurrency 10", "dbos", "workflows",
        "workflows_per_s", True, "workflows/s"),
    Row("20 parents x 100 children with result waits", "dbos", "fanout", "children_per_s",
        True, "children/s"),
    Row("CPU per durable step (worker + backends)", "dbos", "workflows", "cpu_ms_per_step",
        False, "ms"),
)

PEER_NAMES = {"pgqueuer": "PgQueuer", "dbos": "DBOS"}

#: (peer, workload) -> (theirs per round, ours per round).
Results = dict[tuple[str, str], tuple[list[Figures], list[Figures]]]


def workloads(peer: str) -> list[str]:
    """The peer's workloads the table needs, in the order of its rows."""
    return list(dict.fromkeys(row.workload for row in ROWS if row.peer == peer))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pgqueuer-python", required=True, metavar="PATH",
                        help="an interpreter with pgqueuer, asyncpg and uvloop installed")
    parser.add_argument("--dbos-python", required=True, metavar="PATH",
                        help="an interpreter with dbos installed")
    parser.add_argument("--poll", type=float, default=0.01, metavar="SECONDS",
                        help="DBOS's queue polling interval (0.01)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write every round's figures and the medians here")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.poll <= 0:
        parser.error("--poll must be positive")
    args.only = ""
    selected(parser, args, [""])
    return args


def _value(row: Row, value: float) -> str:
    if row.unit == "ms":
        return f"{value:.3f} ms" if row.figure.startswith("cpu") else f"{value:.2f} ms"
    return f"{value:,.0f}/s"


def table(results: Results) -> list[str]:
    """The issue's table as Markdown lines: ours, theirs, ours / theirs, which way is better."""
    lines = [
        "| workload | ours | theirs | ours / theirs | better |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        theirs_rounds, ours_rounds = results.get((row.peer, row.workload), ([], []))
        theirs, mine = medians(theirs_rounds), medians(ours_rounds)
        if row.figure not in theirs or row.figure not in mine:
            lines.append(f"| {row.label} | not measured | | | |")
            continue
        ratio = mine[row.figure] / theirs[row.figure] if theirs[row.figure] else float("nan")
        lines.append(
            f"| {row.label} | {_value(row, mine[row.figure])} | "
            f"{PEER_NAMES[row.peer]} {_value(row, theirs[row.figure])} | {ratio:.2f} | "
            f"{'higher' if row.higher_is_better else 'lower'} |"
        )
    return lines


def host_line(poll: float, rounds: int, quick: bool) -> str:
    """Where and when: the host, its CPUs, load average, the commit and the date (UTC)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except OSError:
        commit = ""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{now}, {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}), "
        f"load average {load}, commit {commit or '?'}, {rounds} round(s)"
        f"{' --quick' if quick else ''}, DBOS queue poll {poll * 1000:g} ms"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: Results = {}
    started = host_line(args.poll, args.rounds, args.quick)
    with server(args.database_url) as found, tempfile.TemporaryDirectory() as tmp:
        url = psycopg_url(found.url)
        pgq = pgqueuer_compare.PgQueuer(
            args.pgqueuer_python, url, Path(tmp), 5_000 if args.quick else pgqueuer_compare.DRAIN
        )
        dbos = dbos_compare.Dbos(args.dbos_python, url, Path(tmp), args.poll)
        for index in range(args.rounds):
            ours_first = index % 2 == 1
            for peer in ("pgqueuer", "dbos"):
                for workload in workloads(peer):
                    if peer == "pgqueuer":
                        sides = pgqueuer_compare.measure(pgq, url, workload, ours_first,
                                                         args.quick)
                    else:
                        sides = dbos_compare.measure(dbos, url, workload, ours_first, args.quick)
                    theirs, mine = results.setdefault((peer, workload), ([], []))
                    theirs.append(sides[0])
                    mine.append(sides[1])
                    print(f"round {index + 1} {workload:15} {PEER_NAMES[peer]:9} "
                          f"{fmt(sides[0])}  |  ours {fmt(sides[1])}", flush=True)
    print()
    print(f"started {started}")
    print(f"ended   {host_line(args.poll, args.rounds, args.quick)}")
    print()
    print("\n".join(table(results)))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "started": started,
            "rounds": {f"{peer}/{workload}": {"theirs": theirs, "ours": mine}
                       for (peer, workload), (theirs, mine) in results.items()},
            "table": table(results),
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
