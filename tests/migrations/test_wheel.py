"""The wheel ships what the Alembic integration needs, and it works from an installed wheel.

``alembic_templates/`` sits outside the package in the source tree; pyproject force-includes
it as ``sqlalchemy_pgtask/alembic_templates``, where `init_alembic_env` looks first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from sqlalchemy_pgtask.migrations import head_revision

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built the way a release builds it (isolated build)."""
    outdir = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = outdir.glob("sqlalchemy_pgtask-*.whl")
    return built


def test_wheel_ships_the_alembic_template_the_revisions_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())

    assert {
        "sqlalchemy_pgtask/alembic_templates/pgtask/env.py",
        "sqlalchemy_pgtask/alembic_templates/pgtask/alembic.ini.mako",
        "sqlalchemy_pgtask/alembic_templates/pgtask/script.py.mako",
        "sqlalchemy_pgtask/alembic_templates/pgtask/README",
        "sqlalchemy_pgtask/alembic_env.py",
        "sqlalchemy_pgtask/py.typed",
        "sqlalchemy_pgtask/migrations/env.py",
        "sqlalchemy_pgtask/migrations/versions/pgtask_0001_initial.py",
        "sqlalchemy_pgtask/migrations/versions/pgtask_0002_runtime_v2.py",
        "sqlalchemy_pgtask/migrations/versions/pgtask_0003_durable.py",
    } <= names
    # The dashboard's templates and stylesheet are package data, read from the install.
    assert {
        "sqlalchemy_pgtask/dashboard/templates/base.html",
        "sqlalchemy_pgtask/dashboard/templates/task.html",
        "sqlalchemy_pgtask/dashboard/static/dashboard.css",
    } <= names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


_CHECK_INSTALLED = textwrap.dedent("""
    import sys
    from pathlib import Path

    import sqlalchemy_pgtask.alembic_env as alembic_env

    package = Path(alembic_env.__file__).parent
    assert Path(sys.prefix) in package.parents, f"not the installed wheel: {package}"
    template = alembic_env._template_directory()
    assert template == package / "alembic_templates", template
    alembic_env.init_alembic_env("migrations", config_path="alembic.ini")
""")


def test_init_alembic_env_works_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    # A fresh venv with only the wheel in it; its dependencies come from the test venv's
    # site-packages (a .pth line adds that directory, but not the editable checkout that
    # one of its own .pth files points at).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site_packages = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )
    deps = {p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()}
    (site_packages / "test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True, check=True, timeout=120,
    )
    project = tmp_path / "project"
    project.mkdir()
    clean_env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}

    created = subprocess.run(
        [str(python), "-c", _CHECK_INSTALLED],
        cwd=project, env=clean_env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    assert "script_location = %(here)s/migrations" in (project / "alembic.ini").read_text()

    # The ini's "sqlalchemy_pgtask:migrations/versions" resolves inside the installed wheel.
    heads = subprocess.run(
        [str(python), "-m", "alembic", "-c", "alembic.ini", "heads", "--verbose"],
        cwd=project, env=clean_env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert heads.returncode == 0, heads.stdout + heads.stderr
    head = head_revision()
    assert f"Rev: {head} (head)" in heads.stdout
    assert "Branch names: pgtask" in heads.stdout
    installed_versions = site_packages / "sqlalchemy_pgtask" / "migrations" / "versions"
    assert f"Path: {installed_versions}{os.sep}{head}_" in heads.stdout
