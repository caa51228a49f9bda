"""The framework examples under ``examples/`` work as their docstrings say, against a real
database: the FastAPI application with a real worker process, the plain script, and the
example of an application's own handler tests run by pytest.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType

from starlette.testclient import TestClient

from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.testing import ServerInfo
from tests.support.examples import EXAMPLES, load_example, run_example_script
from tests.support.workerproc import Database, WorkerLauncher

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def fastapi_example() -> ModuleType:
    """``examples/fastapi_app.py``, imported under the name its worker command uses."""
    return load_example("fastapi_app")


def test_fastapi_example_commits_the_signup_with_its_task_and_reports_the_workers_result(
    db: Database, tmp_path: Path
) -> None:
    example = fastapi_example()
    shutil.copy(EXAMPLES / "fastapi_app.py", tmp_path)
    workers = WorkerLauncher(tmp_path, db, "fastapi_app:registry")
    try:
        with TestClient(example.create_application(db.url)) as client:
            invalid = client.post("/signups", json={"email": "not an address"})
            created = client.post("/signups", json={"email": "ada@example.com"})
            task_id = created.json()["task_id"]
            before = client.get(f"/tasks/{task_id}")
            workers.start()  # `pgtask worker fastapi_app:registry`, as the docstring says
            waited = client.get(f"/tasks/{task_id}", params={"timeout": 30})
            unknown = client.get(f"/tasks/{uuid.uuid4()}", params={"timeout": 1})
            too_long = client.get(f"/tasks/{task_id}", params={"timeout": 3600})
    finally:
        workers.close()

    assert invalid.status_code == 422
    assert created.status_code == 201, created.text
    assert created.json()["signup_id"] == 1
    assert before.json()["state"] == "pending"
    assert waited.status_code == 200, waited.text
    assert waited.json()["state"] == "succeeded"
    assert waited.json()["result"] == {"sent_to": "ada@example.com", "signup_id": 1}
    assert unknown.status_code == 404
    assert too_long.status_code == 422
    # The refused request wrote nothing; the accepted one wrote its row and its task.
    assert [tuple(row) for row in db.rows("SELECT id, email FROM signups")] == [
        (1, "ada@example.com")
    ]
    assert db.scalar("SELECT idempotency_key FROM pgtask.tasks") == "welcome-1"


def test_fastapi_example_serves_the_dashboard_under_its_prefix_behind_its_own_auth(
    db: Database,
) -> None:
    example = fastapi_example()
    with TestClient(example.create_application(db.url), follow_redirects=False) as client:
        assert client.post("/signups", json={"email": "ada@example.com"}).status_code == 201
        anonymous = client.get("/pgtask/")
        viewer = client.get("/pgtask/", headers={"x-user": "bob"})
        operator = client.get("/pgtask/", headers={"x-user": "alice"})
        token = client.cookies.get("pgtask_csrf")
        assert token is not None
        refused = client.post(
            "/pgtask/queues/emails/pause", data={"csrf_token": token}, headers={"x-user": "bob"}
        )
        paused = client.post(
            "/pgtask/queues/emails/pause", data={"csrf_token": token},
            headers={"x-user": "alice"},
        )

    assert anonymous.status_code == 401
    assert viewer.status_code == 200
    pause_form = 'action="/pgtask/queues/emails/pause"'
    assert 'data-testid="actor"' not in viewer.text
    assert pause_form not in viewer.text
    assert operator.status_code == 200
    assert 'href="/pgtask/tasks"' in operator.text
    assert "app:alice" in operator.text
    assert pause_form in operator.text
    found = CSRF.search(operator.text)
    assert found is not None
    assert found.group(1) == token
    assert refused.status_code == 403
    assert paused.status_code == 303
    with db.engine.connect() as connection:
        (entry,) = list_audit(connection, queue="emails")
    assert (entry.action, entry.actor) == ("queue.pause", "app:alice")


def test_plain_script_example_runs_its_task_and_prints_the_result(
    pgtask_database_url: str, tmp_path: Path
) -> None:
    out = run_example_script("plain_script.py", pgtask_database_url, tmp_path)
    assert "enqueued in the same transaction" in out
    assert "task succeeded after 1 attempt(s): {'invoice_id': 1, 'total_cents': 3750}" in out
    assert "invoice 1 is totalled" in out


def test_handler_tests_example_passes_under_pytest_in_a_project_of_its_own(
    pgtask_server: ServerInfo, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLES / "handler_tests", project,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PGTASK_"))}
    env["PGTASK_TEST_DATABASE_URL"] = pgtask_server.url

    # The command of the example's docstring, in a directory with no pytest configuration.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=project, env=env, capture_output=True, text=True, timeout=240, check=False,
    )

    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = re.search(r"^=+ (.*) in [\d.]+s =+$", result.stdout, re.M)
    assert summary is not None, output
    assert re.fullmatch(r"3 passed(, \d+ warnings?)?", summary.group(1)), output
