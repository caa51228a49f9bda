"""_version: the installed distribution's version, for the package, spans and registrations."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

__all__ = ["__version__"]

try:
    __version__ = _version("sqlalchemy-pgtask")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"
