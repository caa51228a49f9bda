"""What the ``pgtask`` command writes to an operator's terminal is safe to write there.

Task names and queue names are validated; most of what the commands print is not: a handler's
exception message and traceback, payloads, idempotency keys, audit actors and reasons, a
schedule's last error, a worker's host name. Any of it may hold terminal control sequences
(``ESC ]0;...BEL`` retitles the window, ``ESC [2J`` clears the screen, ``\\r`` overwrites the
line, the one-byte CSI ``U+009B``), and printed raw they would let whoever wrote the data
rewrite what the operator sees. So every command prints them escaped (``\\u001b``), in text and
in JSON (where the escape is the same value), and the output stays one line per line.

Also here: a closed standard output (``pgtask task list | head -1``) ends the command
quietly, and output the terminal's encoding cannot represent is escaped, not a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_until
from tests.support.workerproc import PGTASK, Database, WorkerLauncher, cli_env, lines, run_cli

#: Control sequences an attacker would use: retitle the window, clear the screen, go back
#: to the start of the line, and the one-byte C1 CSI (which json.dumps leaves raw).
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\rforged\x9b31m\x7f"

_APP = '''
from sqlalchemy_pgtask import Registry, RetryPolicy

registry = Registry()


@registry.task("hostile", retry=RetryPolicy.never())
async def hostile(ctx, payload):
    raise RuntimeError(payload["message"])
'''


def _controls(text: str) -> list[str]:
    """The control characters of ``text`` other than the newlines that end its lines."""
    return [
        f"U+{ord(c):04X}" for c in text if c != "\n" and unicodedata.category(c) == "Cc"
    ]


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result
    assert result.stderr == "", result.stderr
    return result.stdout


class Hostile:
    """A database whose user data is full of control sequences, as real writers put it there."""

    def __init__(self, directory: Path, db: Database, workers: WorkerLauncher) -> None:
        self.directory = directory
        self.db = db
        [self.task_id] = db.enqueue(
            "hostile", {"message": HOSTILE}, idempotency_key=f"key-{HOSTILE}",
            headers={"trace": HOSTILE},
        )
        worker = workers.start()
        wait_until(lambda: db.state(self.task_id) == "failed", 30, describe=worker.describe)
        # Any operator (or the dashboard) can write an audit entry with this actor and reason.
        _ok(self.cli("queue", "pause", "default", "--actor", f"mallory{HOSTILE}",
                     "--reason", f"why{HOSTILE}"))
        _ok(self.cli("schedule", "set", "nightly", "--task", "hostile", "--every", "3600"))
        # What a failed materialisation records, and the host name a worker registers with.
        db.execute("UPDATE pgtask.schedules SET last_error = :e", e=f"boom{HOSTILE}")
        db.execute(
            "INSERT INTO pgtask.workers (id, queues, version, hostname, pid, concurrency,"
            " expires_at) VALUES (:id, ARRAY['default'], 'x', :host, 1, 1,"
            " statement_timestamp() + interval '1 hour')",
            id=uuid.uuid4(), host=f"host{HOSTILE}",
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "--database-url", self.db.url, cwd=self.directory)


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hostile")
    (directory / "hostile_app.py").write_text(_APP)
    return directory


@pytest.fixture
def hostile(hostile_dir: Path, db: Database) -> Iterator[Hostile]:
    launcher = WorkerLauncher(hostile_dir, db, "hostile_app:registry")
    try:
        yield Hostile(hostile_dir, db, launcher)
    finally:
        launcher.close()


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["task", "show", "{task}"],
        ["task", "explain", "{task}"],
        ["audit"],
        ["schedule", "list"],
    ],
    ids=" ".join,
)
def test_user_data_is_printed_without_terminal_control_characters(
    hostile: Hostile, command: list[str]
) -> None:
    out = _ok(hostile.cli(*(arg.format(task=hostile.task_id) for arg in command)))
    assert _controls(out) == [], out
    # Escaped, not dropped: the operator can still see that something odd is there.
    assert "\\u001b]0;pwned\\u0007" in out, out


@pytest.mark.parametrize(
    "command", [["task", "show", "{task}", "--json"], ["audit", "--json"]], ids=" ".join
)
def test_json_output_escapes_every_control_character_and_keeps_the_values(
    hostile: Hostile, command: list[str]
) -> None:
    out = _ok(hostile.cli(*(arg.format(task=hostile.task_id) for arg in command)))
    assert _controls(out) == [], out
    document: Any = json.loads(out)
    if command[0] == "task":
        task = document["task"]
        assert task["payload"] == {"message": HOSTILE}
        assert task["idempotency_key"] == f"key-{HOSTILE}"
        assert task["error"]["message"] == HOSTILE
    else:
        [pause] = [entry for entry in document if entry["action"] == "queue.pause"]
        assert pause["actor"] == f"mallory{HOSTILE}"
        assert pause["reason"] == f"why{HOSTILE}"


def test_an_error_message_is_printed_without_terminal_control_characters(
    app_dir: Path, db: Database
) -> None:
    # The server's message quotes the value it refused.
    result = run_cli("task", "list", "--database-url",
                     f"{db.url}?options=-c%20statement_timeout%3D%1B%5B2J", cwd=app_dir)
    assert result.returncode == 1, result
    [line] = lines(result.stderr)
    assert line.startswith("pgtask: error: "), line
    assert _controls(result.stderr) == [], result.stderr


def _closed_stdout(app_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``pgtask ARGS`` with its standard output a pipe nobody reads any more, buffered
    as it is in a shell pipeline (``pgtask task list | head -1``, ``head`` gone)."""
    env = cli_env()
    env.pop("PYTHONUNBUFFERED", None)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [str(PGTASK), *args], cwd=app_dir, env=env, stdout=write_end,
            stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("count", [1, 3000], ids=["one line", "more than a pipe holds"])
def test_a_closed_standard_output_ends_the_command_quietly(
    app_dir: Path, db: Database, count: int
) -> None:
    db.enqueue("job", {}, count=count)

    result = _closed_stdout(app_dir, "task", "list", "--limit", "10000",
                            "--database-url", db.url)

    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE: what a shell reports for `cat | head`


@pytest.mark.parametrize("password", ["s3/cr3t", "s3@cr3t", "s3/cr@3t"])
def test_a_password_with_a_slash_or_an_at_sign_is_not_echoed(
    app_dir: Path, password: str
) -> None:
    result = run_cli("status", "--database-url", f"postgresql://app:{password}@db:abc/app",
                     cwd=app_dir)
    assert result.returncode == 2, result
    for fragment in password.replace("@", "/").split("/"):
        assert fragment not in result.stderr, result.stderr
    assert "invalid database URL 'postgresql://app:***@" in result.stderr


def test_output_the_terminal_cannot_encode_is_escaped_not_a_traceback(
    app_dir: Path, db: Database
) -> None:
    [task_id] = db.enqueue("job", {"city": "Zürich ☃"})

    result = run_cli("task", "show", str(task_id), "--database-url", db.url, cwd=app_dir,
                     env=cli_env({"PYTHONIOENCODING": "ascii"}))

    assert result.returncode == 0, result.stderr
    assert '"city": "Z\\xfcrich \\u2603"' in result.stdout
