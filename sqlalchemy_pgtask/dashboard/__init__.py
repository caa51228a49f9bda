"""dashboard: a web UI for operators (queues, tasks, workers, schedules, the audit log), as an
ASGI application to serve with ``pgtask dashboard`` or mount inside your own; read-only unless
an admin token or your own auth allows actions, and every action goes through the library's
audited functions, never a write of its own.

Needs the ``dashboard`` extra (``pip install "sqlalchemy-pgtask[dashboard]"``): Starlette,
Jinja2 and python-multipart; uvicorn to serve it from the command line.

::

    from sqlalchemy_pgtask.dashboard import create_app

    app = create_app("postgresql://app@db/app", admin_token=os.environ["PGTASK_DASHBOARD_TOKEN"])

See docs/dashboard.md.
"""

from __future__ import annotations

from typing import Final

__all__ = ["INSTALL_HINT", "create_app"]

#: What to run when the extra is missing.
INSTALL_HINT: Final = 'pip install "sqlalchemy-pgtask[dashboard]"'

try:
    from sqlalchemy_pgtask.dashboard._app import create_app
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    if exc.name not in {"starlette", "jinja2", "multipart", "python_multipart"}:
        raise
    raise ImportError(
        f"the pgtask dashboard needs the 'dashboard' extra: {INSTALL_HINT}", name=exc.name
    ) from exc
