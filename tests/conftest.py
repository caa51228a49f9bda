"""Shared test configuration. Database fixtures come from the ``sqlalchemy_pgtask.testing``
plugin, which the package registers with pytest (entry point ``pytest11``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A run that selects nothing must fail loudly rather than pass: see pytest_sessionfinish.
    config.stash[_COLLECTED] = len(items)


_COLLECTED = pytest.StashKey[int]()
