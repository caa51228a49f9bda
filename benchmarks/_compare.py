"""benchmarks/_compare.py: what the same-host comparisons share (``pgqueuer_compare.py``,
``dbos_compare.py``, ``compare.py``): running one of our benchmark scripts in a subprocess,
waiting on a peer's processes, alternating the two sides, medians and the printed figures.

No peer is imported here: each runs in its own interpreter, given on the command line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: One measurement: figure name -> value (``tasks_per_s``, ``p50_ms``, ``cpu_ms_per_task``...).
Figures = dict[str, float]


def add_arguments(parser: argparse.ArgumentParser, workloads: Sequence[str] = ()) -> None:
    """The options every comparison takes: the server, the rounds, a smoke run (and
    ``--only``, given the script's ``workloads``)."""
    parser.add_argument("--database-url", metavar="URL",
                        help="a server where CREATE DATABASE works (default: provide_server)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternated rounds, medians reported (3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: smaller counts and one round unless --rounds")
    if workloads:
        parser.add_argument("--only", default=",".join(workloads),
                            help=f"comma-separated, of {', '.join(workloads)} (all)")


def selected(
    parser: argparse.ArgumentParser, args: argparse.Namespace, workloads: Sequence[str]
) -> list[str]:
    """``--only``'s workloads (a usage error for an unknown one); sets ``args.rounds``."""
    names = [w.strip() for w in args.only.split(",")]
    if unknown := set(names) - set(workloads):
        parser.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.rounds = args.rounds or (1 if args.quick else 3)
    return names


def run_rounds(
    workloads: Sequence[str], rounds: int, peer: str,
    measure: Callable[[str, bool], tuple[Figures, Figures]],
) -> None:
    """``rounds`` alternated rounds of ``measure(workload, ours_first)``: each measurement as it
    comes, then the medians."""
    results: dict[tuple[str, str], list[Figures]] = {}
    for index in range(rounds):
        for workload in workloads:
            sides = measure(workload, index % 2 == 1)
            for name, figures in zip((peer, "sqlalchemy_pgtask"), sides, strict=True):
                results.setdefault((workload, name), []).append(figures)
                print(f"round {index + 1} {workload:15} {name:18} {fmt(figures)}", flush=True)
    for (workload, name), measured in results.items():
        print(f"median  {workload:15} {name:18} {fmt(medians(measured))}")


def run_ours(script: str, args: Sequence[str], out: Path) -> dict[str, Any]:
    """``benchmarks/<script> ARGS --json OUT``, once; the JSON document it wrote."""
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, str(HERE / script), *args, "--json", str(out)],
        capture_output=True, text=True,
    )
    if done.returncode:
        raise RuntimeError(f"{script} exited with {done.returncode}: {done.stderr[-2000:]}")
    document: dict[str, Any] = json.loads(out.read_text())
    return document


def wait_until(
    done: Callable[[], bool], proc: subprocess.Popen[bytes], seconds: float, what: str,
    interval: float = 0.01, peer: str = "peer",
) -> None:
    """Poll ``done`` for a worker that may end by itself once its work ran: ``done`` turning
    true as the worker exits is no failure."""
    deadline = time.monotonic() + seconds
    while not done():
        if proc.poll() is not None and not done():
            raise RuntimeError(f"{what}: the {peer} worker exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {seconds:.0f} s")
        time.sleep(interval)


def stop(proc: subprocess.Popen[bytes], seconds: float = 30) -> None:
    """Wait for the worker to end by itself (it stops after its last job), else kill it."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pair(
    theirs: Callable[[], Figures], ours: Callable[[], Figures], ours_first: bool
) -> tuple[Figures, Figures]:
    """Both sides of one measurement, in the order given (rounds alternate who goes first, so
    neither always inherits the other's dirty page cache or warm CPU)."""
    if ours_first:
        mine = ours()
        return theirs(), mine
    peer = theirs()
    return peer, ours()


def medians(rounds: Sequence[Figures]) -> Figures:
    """Each figure's median over the rounds that have it."""
    keys = {k for r in rounds for k in r}
    return {k: float(statistics.median(r[k] for r in rounds if k in r)) for k in sorted(keys)}


def fmt(figures: Figures) -> str:
    parts = []
    for key, value in figures.items():
        digits = 0 if value >= 100 else 3 if value < 1 else 2
        parts.append(f"{key} {value:,.{digits}f}")
    return "  ".join(parts)
