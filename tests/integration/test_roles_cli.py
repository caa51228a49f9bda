"""``pgtask grants`` end to end: a subprocess grants the four levels, or prints the SQL that
`grants_sql` returns; the roles then hold exactly their levels' privileges, and the operator
commands work (or are refused) as each role."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sqlalchemy import Engine

from sqlalchemy_pgtask import enqueue
from sqlalchemy_pgtask.grants import LEVELS, grants_sql
from tests.integration.test_roles_matrix import EXPECTED
from tests.support.roles import expand, login_roles, privileges_of, role_url
from tests.support.workerproc import run_cli


def _error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("pgtask: error: ")
    return line


def test_pgtask_grants_gives_each_role_exactly_its_level(
    pgtask_database_url: str, pgtask_engine: Engine, tmp_path: Path
) -> None:
    with login_roles(pgtask_database_url, grant=False) as roles:
        options = [arg for level in LEVELS for arg in (f"--{level}", getattr(roles, level))]
        result = run_cli("grants", *options, "--database-url", pgtask_database_url, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("granted: producer ")
        with pgtask_engine.connect() as connection:
            for level in LEVELS:
                held = privileges_of(connection, getattr(roles, level))
                assert sorted(held) == sorted(expand(EXPECTED[level])), level

        # The operator commands as the roles: the observer reads, only the admin cancels.
        with pgtask_engine.begin() as connection:
            task_id = str(enqueue(connection, "job").id)
        observer_url = role_url(pgtask_database_url, roles.observer)
        admin_url = role_url(pgtask_database_url, roles.admin)
        shown = run_cli("status", "--database-url", observer_url, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        refused = run_cli("task", "cancel", task_id, "--database-url", observer_url, cwd=tmp_path)
        assert "42501" in _error(refused, 1)
        assert "lacks a privilege" in refused.stderr
        cancelled = run_cli("task", "cancel", task_id, "--database-url", admin_url, cwd=tmp_path)
        assert cancelled.returncode == 0, cancelled.stderr
        assert "cancelled" in cancelled.stdout


def test_print_sql_prints_what_grants_sql_returns_without_a_database(tmp_path: Path) -> None:
    result = run_cli(
        "grants", "--producer", "app", "--worker", 'w "1"', "--admin", "ops", "--print-sql",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == grants_sql(producer="app", worker='w "1"', admin="ops")
    assert 'TO "w ""1"""' in result.stdout


def test_pgtask_grants_refuses_bad_calls(pgtask_database_url: str, tmp_path: Path) -> None:
    assert "at least one role" in _error(run_cli("grants", "--print-sql", cwd=tmp_path), 2)
    assert "public" in _error(run_cli("grants", "--observer", "public", "--print-sql",
                                      cwd=tmp_path), 2)
    same = run_cli("grants", "--producer", "app", "--admin", "app", "--print-sql", cwd=tmp_path)
    assert "one role per level" in _error(same, 2)
    missing = run_cli(
        "grants", "--producer", "no_such_role_here", "--database-url", pgtask_database_url,
        cwd=tmp_path,
    )
    assert "42704" in _error(missing, 1)


def test_the_sql_in_docs_roles_md_is_what_grants_sql_prints() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "roles.md").read_text()
    marker = "--print-sql` prints"
    block = doc[doc.index(marker):].split("```sql\n", 1)[1].split("```", 1)[0]
    assert block == grants_sql(
        producer="app_producer", worker="app_worker", observer="app_observer", admin="app_admin"
    )
