"""Shared test configuration.

Database fixtures come from the ``sqlalchemy_pgtask.testing`` plugin, which the package
registers with pytest (entry point ``pytest11``), exactly as users of the library get them.
Fixtures more than one suite needs are here; helpers are in ``tests/support``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from tests.support.engines import engine_for


@pytest.fixture
def empty_engine(pgtask_empty_database_url: str) -> Iterator[Engine]:
    """A sync engine on this test's empty database (nothing installed)."""
    with engine_for(pgtask_empty_database_url) as engine:
        yield engine
