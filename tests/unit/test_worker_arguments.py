"""Worker(...) checks its arguments before it opens anything: a typed error for each mistake."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import create_engine

from sqlalchemy_pgtask import InvalidOptionError, Registry, TaskContext, Worker, WorkerOptions


def registry() -> Registry:
    tasks = Registry()

    @tasks.task("noop")
    async def noop(ctx: TaskContext, payload: None) -> None:
        return None

    return tasks


@pytest.mark.parametrize(
    ("database", "options", "field", "says"),
    [
        # A non-PostgreSQL URL used to be rewritten into a PostgreSQL one and accepted.
        ("sqlite:///x.db", None, "database", "PostgreSQL URL, got a 'sqlite' one"),
        ("mysql://u@h/db", None, "database", "PostgreSQL URL, got a 'mysql' one"),
        ("not a url", None, "database", "is not a database URL"),
        # These failed with AttributeError or SQLAlchemy's ArgumentError.
        (12, None, "database", "must be a URL or an AsyncEngine, got int"),
        ("postgresql://u@h/db", {"concurrency": 2}, "options", "must be a WorkerOptions"),
    ],
)
def test_bad_arguments_are_typed_errors(
    database: Any, options: Any, field: str, says: str
) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        Worker(registry(), database, options)
    assert caught.value.field == field
    assert says in str(caught.value)


def test_a_synchronous_engine_is_refused_with_what_to_pass_instead() -> None:
    engine = create_engine("postgresql+psycopg://u@h/db")
    with pytest.raises(InvalidOptionError, match="a worker needs an AsyncEngine"):
        Worker(registry(), engine, WorkerOptions())  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "postgres://u@h/db",
                                 "postgresql+asyncpg://u@h/db"])
def test_any_postgresql_url_is_taken_and_spoken_to_with_psycopg(url: str) -> None:
    worker = Worker(registry(), url)
    assert worker._engine.url.drivername == "postgresql+psycopg"
