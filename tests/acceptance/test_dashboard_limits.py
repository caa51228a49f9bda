"""``pgtask dashboard`` against hostile clients and addresses it cannot listen on.

Clients that open connections and never finish a request head must not keep others from the
pages: with a file-descriptor limit of 256 (set in the child before it starts), hundreds of
such connections are held while ``GET /`` keeps answering, and an unfinished head is closed
once ``--head-timeout`` has passed. A port in use or a host that does not resolve ends the
command with one ``pgtask: error:`` line and exit 1, without uvicorn's log. Every address the
host resolves to is listened on (``--host ""``: IPv4 and IPv6), and one of them in use is the
same error.

Every wait polls with a deadline; the process is stopped at teardown whatever the test did.
"""

from __future__ import annotations

import resource
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import httpx2
import pytest

from tests.acceptance.conftest import DashboardProcess, free_port
from tests.support.waiting import wait_until
from tests.support.workerproc import Database, lines, run_cli

#: The child's descriptor limit, soft and hard (so it cannot raise it).
FD_LIMIT: Final = 256
#: The start of a request whose head never ends (no blank line).
UNFINISHED: Final = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
#: A whole head whose body never comes.
NO_BODY: Final = (
    b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 4096\r\n\r\ntoken="
)


def _small_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.fixture
def limited(
    dashboards: Callable[..., DashboardProcess],
) -> Callable[..., DashboardProcess]:
    """Start ``pgtask dashboard`` with a descriptor limit of `FD_LIMIT` and ARGS, once it
    answers; every one is stopped at teardown."""

    def start(database_url: str, *args: str) -> DashboardProcess:
        return dashboards(database_url, *args, log_level="warning", preexec_fn=_small_fd_limit)

    return start


@pytest.fixture
def slow_clients() -> Iterator[Callable[..., list[socket.socket]]]:
    """Open COUNT connections to PORT that each send SENT (an unfinished head); all closed at
    the end."""
    opened: list[socket.socket] = []

    def open_(port: int, count: int, sent: bytes = UNFINISHED) -> list[socket.socket]:
        batch: list[socket.socket] = []
        for _ in range(count):
            client = socket.socket()
            opened.append(client)
            client.settimeout(10.0)
            try:
                client.connect(("127.0.0.1", port))
                client.sendall(sent)
            except OSError:
                continue  # the server closed it to make room: what it is meant to do
            batch.append(client)
        return batch

    try:
        yield open_
    finally:
        for client in opened:
            client.close()


def _closed_by_server(client: socket.socket) -> bool:
    client.setblocking(False)
    try:
        return client.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def test_pages_answer_while_more_unfinished_heads_are_open_than_descriptors(
    db: Database,
    limited: Callable[..., DashboardProcess],
    slow_clients: Callable[..., list[socket.socket]],
) -> None:
    # A head timeout far beyond the test: only the connection cap can keep pages answering.
    dashboard = limited(db.url, "--head-timeout", "600")
    port = int(dashboard.url.rsplit(":", 1)[1])
    for _ in range(3):
        slow_clients(port, FD_LIMIT)
        wait_until(dashboard.answers, 15.0, interval=0.1,
                   message="GET / to answer with unfinished heads open",
                   describe=dashboard.describe)
    assert dashboard.process.poll() is None, dashboard.describe()


@pytest.mark.parametrize("sent", [UNFINISHED, NO_BODY], ids=["head", "body"])
def test_an_unfinished_request_is_closed_after_the_head_timeout(
    db: Database,
    limited: Callable[..., DashboardProcess],
    slow_clients: Callable[..., list[socket.socket]],
    sent: bytes,
) -> None:
    dashboard = limited(db.url, "--head-timeout", "1")
    port = int(dashboard.url.rsplit(":", 1)[1])
    clients = slow_clients(port, 10, sent)
    assert len(clients) == 10  # far below the cap: none closed to make room
    wait_until(lambda: all(_closed_by_server(client) for client in clients), 15.0,
               interval=0.1, message="the server to close every unfinished request",
               describe=dashboard.describe)
    assert dashboard.answers()


def _assert_one_error_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    errors = lines(result.stderr)
    assert errors, output
    assert errors[-1].startswith("pgtask: error: "), output
    assert expected in errors[-1], output
    assert len(errors) == 1, output  # no server log, no traceback
    assert "pgtask dashboard on" not in result.stdout, output


def test_a_port_in_use_is_one_error_line_and_exit_1(db: Database, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("dashboard", "--database-url", db.url, "--host", "127.0.0.1",
                         "--port", str(port), cwd=tmp_path)
    _assert_one_error_line(result, f"cannot serve the dashboard on 127.0.0.1:{port}")


def test_a_host_that_does_not_resolve_is_one_error_line_and_exit_1(
    db: Database, tmp_path: Path
) -> None:
    result = run_cli("dashboard", "--database-url", db.url, "--host", "no-such-host.invalid",
                     "--port", str(free_port()), cwd=tmp_path)
    _assert_one_error_line(result, "cannot serve the dashboard on no-such-host.invalid:")


@pytest.mark.parametrize("value", ["0", "-1", "inf", "soon"])
def test_a_head_timeout_that_is_not_a_positive_number_is_a_usage_error(
    tmp_path: Path, value: str
) -> None:
    # Closed port: the usage error comes before any connection is tried.
    result = run_cli("dashboard", "--database-url", "postgresql://nobody@127.0.0.1:1/none",
                     "--head-timeout", value, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--head-timeout" in lines(result.stderr)[-1], result.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")


@needs_ipv6
def test_every_address_the_host_resolves_to_is_listened_on(
    db: Database, dashboards: Callable[..., DashboardProcess]
) -> None:
    # "" resolves to 0.0.0.0 and ::; only the first of them was listened on.
    dashboard = dashboards(db.url, "--host", "")
    port = int(dashboard.url.rsplit(":", 1)[1])
    for url in (f"http://127.0.0.1:{port}/login", f"http://[::1]:{port}/login"):
        assert httpx2.get(url, timeout=5.0).status_code == 200, (url, dashboard.describe())
    assert f"pgtask dashboard on http://0.0.0.0:{port}/" in dashboard.log(), dashboard.describe()


@needs_ipv6
def test_one_address_of_the_host_in_use_is_one_error_line_and_exit_1(
    db: Database, tmp_path: Path
) -> None:
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("dashboard", "--database-url", db.url, "--host", "", "--port",
                         str(port), cwd=tmp_path)
    _assert_one_error_line(result, f"cannot serve the dashboard on :{port}")
