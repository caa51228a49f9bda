"""Database URLs as libpq writes them: the multi-host failover form is taken everywhere.

No database: what each form becomes, and what psycopg is handed to connect with.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from sqlalchemy import create_engine

from sqlalchemy_pgtask import InvalidOptionError, Registry, TaskContext, Worker
from sqlalchemy_pgtask._url import database_url
from sqlalchemy_pgtask.cli._connection import database_url as cli_database_url
from sqlalchemy_pgtask.cli._errors import UsageError

FAILOVER = "postgresql://app:s3cret@h1:5432,h2:5433/orders?target_session_attrs=read-write"


def connect_arguments(url: str) -> dict[str, Any]:
    """What SQLAlchemy hands psycopg for ``url`` (as libpq connection parameters)."""
    engine = create_engine(database_url(url))
    _, params = engine.dialect.create_connect_args(engine.url)
    params.pop("context", None)
    return dict(params)


def test_a_host_list_reaches_psycopg_as_libpq_host_and_port_lists() -> None:
    # make_url raised ValueError("invalid literal for int() with base 10: '5432,h2:5433'").
    assert connect_arguments(FAILOVER) == {
        "host": "h1,h2", "port": "5432,5433", "user": "app", "password": "s3cret",
        "dbname": "orders", "target_session_attrs": "read-write",
    }


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("postgresql://u@h1,h2/db", "h1,h2", ","),  # empty ports: each host's default
        ("postgresql://u@h1:6000,h2/db", "h1,h2", "6000,"),
        ("postgresql://u@[::1]:5432,[fe80::2]:5433/db", "::1,fe80::2", "5432,5433"),
        ("postgresql://u@%2Ftmp%2Fpg,h2:5433/db", "/tmp/pg,h2", ",5433"),
        ("postgres://u@h1,h2,h3:7/db", "h1,h2,h3", ",,7"),
    ],
)
def test_host_list_shapes(url: str, host: str, port: str) -> None:
    params = connect_arguments(url)
    assert (params["host"], params["port"]) == (host, port)


def test_a_password_with_commas_and_at_signs_stays_the_password() -> None:
    params = connect_arguments("postgresql://u:a%2Cb%40c@h1,h2/db")
    assert params["password"] == "a,b@c"
    assert params["host"] == "h1,h2"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h1,h2:5433/db?application_name=a@b",
        "postgresql://u@h1,h2:5433?application_name=a@b",
        "postgresql://u:p@ss@h1,h2:5433/db?application_name=a@b",
    ],
)
def test_an_at_sign_in_the_query_of_a_host_list_stays_in_the_query(url: str) -> None:
    # The userinfo reached the query's '@': the "hosts" were "b" (no list), so make_url
    # got the whole string and failed on the port "5433/db?application_name=a".
    params = connect_arguments(url)
    assert (params["host"], params["port"], params["user"]) == ("h1,h2", ",5433", "u")
    assert params["application_name"] == "a@b"
    assert params.get("password") in (None, "p@ss")


def test_a_single_host_url_is_unchanged_but_for_the_driver() -> None:
    url = database_url("postgresql+psycopg2://u:p@h:6432/db?sslmode=require")
    assert url.render_as_string(hide_password=False) == (
        "postgresql+psycopg://u:p@h:6432/db?sslmode=require"
    )


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://u@h1:abc,h2/db", "port 'abc' of host 'h1:abc' is not a port number"),
        ("postgresql://u@h1:70000,h2/db", "is not a port number"),
        ("postgresql://u@h:abc/db", "is not a database URL"),
        ("postgresql://u@h:0/db", "out of range"),
        ("postgresql://u@h1,h2/db?host=h3", "both before the database name and as ?host="),
        ("postgresql://u@h1,[::1/db", "is not host[:port]"),
        ("mysql://u@h1,h2/db", "must be a PostgreSQL URL, got a 'mysql' one"),
        ("not a url", "is not a database URL"),
    ],
)
def test_a_bad_url_is_an_invalid_option_error(url: str, says: str) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        database_url(url)
    assert caught.value.field == "database"
    assert says in str(caught.value)


def test_a_bad_url_does_not_echo_its_password() -> None:
    with pytest.raises(InvalidOptionError) as caught:
        database_url("postgresql://u:s3cret@h1:x,h2/db")
    assert "s3cret" not in str(caught.value)


def registry() -> Registry:
    tasks = Registry()

    @tasks.task("noop")
    async def noop(ctx: TaskContext, payload: None) -> None:
        return None

    return tasks


def test_a_worker_takes_a_failover_url() -> None:
    # Worker(registry, url) raised a bare ValueError.
    worker = Worker(registry(), FAILOVER)
    url = worker._engine.url
    assert url.drivername == "postgresql+psycopg"
    assert url.query["host"] == "h1,h2"
    assert url.query["target_session_attrs"] == "read-write"


def test_a_worker_given_a_bad_port_in_a_host_list_raises_invalid_option_error() -> None:
    with pytest.raises(InvalidOptionError, match=r"database: .* is not a port number"):
        Worker(registry(), "postgresql://u@h1:5432,h2:nope/db")


def test_the_command_line_takes_a_failover_url_and_refuses_a_bad_one() -> None:
    url = cli_database_url(argparse.Namespace(database_url=FAILOVER))
    assert connect_arguments(url)["host"] == "h1,h2"
    with pytest.raises(UsageError, match="invalid database URL 'postgresql://u:\\*\\*\\*@"):
        cli_database_url(argparse.Namespace(database_url="postgresql://u:pw@h1:x,h2/db"))


def test_the_test_fixtures_take_a_failover_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy_pgtask.testing._server import _url_server

    monkeypatch.setenv("PGTASK_TEST_DATABASE_URL", FAILOVER)
    info = _url_server("PGTASK_TEST_DATABASE_URL")
    assert connect_arguments(info.url)["host"] == "h1,h2"
