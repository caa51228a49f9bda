"""docs/griffe_literal_blocks.py turns the docstrings' reStructuredText literal blocks into
the fenced code the API reference renders (mkdocs.yml loads it)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import sqlalchemy_pgtask
import sqlalchemy_pgtask.registry
import sqlalchemy_pgtask.worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fence() -> Callable[[str], str]:
    pytest.importorskip("griffe")  # the docs extra
    spec = importlib.util.spec_from_file_location(
        "griffe_literal_blocks", ROOT / "docs" / "griffe_literal_blocks.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rewrite: Callable[[str], str] = module.fence_literal_blocks
    return rewrite


def test_text_ending_in_two_colons_reads_one_and_its_block_is_fenced_python(
    fence: Callable[[str], str],
) -> None:
    text = (
        "Run it like this::\n\n    worker = Worker(registry)\n    await worker.run()\n\n"
        "Then more."
    )
    assert fence(text) == (
        "Run it like this:\n\n```python\nworker = Worker(registry)\nawait worker.run()\n```\n"
        "\nThen more."
    )


def test_a_lone_marker_disappears_and_a_block_that_is_not_python_is_text(
    fence: Callable[[str], str],
) -> None:
    text = "Intro.\n\n::\n\n    pending --claim--> running\n\n      waiting\nAfter."
    assert fence(text) == (
        "Intro.\n\n```text\npending --claim--> running\n\n  waiting\n```\nAfter."
    )


def test_a_block_inside_an_indented_section_keeps_the_section_indent(
    fence: Callable[[str], str],
) -> None:
    text = "Options:\n    Use it so ::\n\n        call()\n    Done."
    assert fence(text) == "Options:\n    Use it so\n\n    ```python\n    call()\n    ```\n    Done."


def test_text_without_a_literal_block_is_unchanged(fence: Callable[[str], str]) -> None:
    for text in ("Plain text.", "Ends in colons::\nbut nothing indented.", ".. note::\n\n    x"):
        assert fence(text) == text


@pytest.mark.parametrize(
    "documented",
    [sqlalchemy_pgtask, sqlalchemy_pgtask.registry, sqlalchemy_pgtask.worker.Worker],
    ids=lambda obj: obj.__name__,
)
def test_the_package_docstrings_keep_no_marker_after_the_rewrite(
    fence: Callable[[str], str], documented: object
) -> None:
    docstring = inspect.getdoc(documented)
    assert docstring is not None
    assert "::" in docstring  # written as reStructuredText ...
    rewritten = fence(docstring)
    assert "::" not in rewritten  # ... and rendered as Markdown
    assert "```python\n" in rewritten
