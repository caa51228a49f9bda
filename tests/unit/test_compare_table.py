"""benchmarks/compare.py's argument parsing and its table, from made-up figures (no database,
no peer, no timing)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PEERS = ["--pgqueuer-python", "/p/python", "--dbos-python", "/d/python"]


@pytest.fixture
def compare(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("compare")


def test_rounds_default_to_three_and_quick_to_one(compare: ModuleType) -> None:
    assert compare.parse_args(PEERS).rounds == 3
    assert compare.parse_args([*PEERS, "--quick"]).rounds == 1
    assert compare.parse_args([*PEERS, "--quick", "--rounds", "5"]).rounds == 5


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--poll", "0"]])
def test_bad_arguments_are_usage_errors(compare: ModuleType, bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        compare.parse_args([*PEERS, *bad])


def test_both_peers_are_required(compare: ModuleType) -> None:
    with pytest.raises(SystemExit):
        compare.parse_args(PEERS[:2])


def test_every_row_has_a_workload_its_peer_measures(compare: ModuleType) -> None:
    pgqueuer = importlib.import_module("pgqueuer_compare")
    dbos = importlib.import_module("dbos_compare")
    assert set(compare.workloads("pgqueuer")) <= set(pgqueuer.WORKLOADS)
    assert set(compare.workloads("dbos")) <= set(dbos.WORKLOADS)


def test_table_shows_medians_and_ours_over_theirs(compare: ModuleType) -> None:
    results = {
        ("pgqueuer", "drain_c10"): (
            [{"tasks_per_s": 4000.0, "cpu_ms_per_task": 0.2},
             {"tasks_per_s": 5000.0, "cpu_ms_per_task": 0.3},
             {"tasks_per_s": 6000.0, "cpu_ms_per_task": 0.1}],
            [{"tasks_per_s": 10000.0, "cpu_ms_per_task": 0.1}] * 3,
        ),
    }
    lines = compare.table(results)
    drain = next(line for line in lines if line.startswith("| drain 20,000"))
    assert drain == (
        "| drain 20,000 no-op tasks, concurrency 10 | 10,000/s | PgQueuer 5,000/s | 2.00 "
        "| higher |"
    )
    cpu = next(line for line in lines if line.startswith("| CPU per task"))
    assert "| 0.100 ms | PgQueuer 0.200 ms | 0.50 | lower |" in cpu
    assert sum("not measured" in line for line in lines) == len(compare.ROWS) - 2


def test_medians_skip_rounds_without_the_figure(compare: ModuleType) -> None:
    helpers = importlib.import_module("_compare")
    assert helpers.medians([{"a": 1.0, "b": 5.0}, {"a": 3.0}]) == {"a": 2.0, "b": 5.0}
