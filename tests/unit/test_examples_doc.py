"""docs/examples.md shows every example's code inline (a code host renders no include), and
that code is the example file's, character for character.

Each example's block follows a comment naming its file, ``<!-- example: examples/X.py -->``.
After changing an example, ``python tests/unit/test_examples_doc.py`` writes the page anew.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
PAGE: Final = ROOT / "docs" / "examples.md"
#: A marker, then the fenced block it names (or, before the first write, an include line).
_BLOCK: Final = re.compile(
    r"^<!-- example: (?P<path>\S+) -->\n(?:```python\n.*?^```$|--8<-- \"(?P=path)\"$)",
    re.M | re.S,
)


def example_files() -> list[str]:
    return sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "examples").rglob("*.py")
        if "__pycache__" not in path.parts
    )


def inlined(markdown: str) -> str:
    """``markdown`` with each marked block holding its file's code."""

    def block(match: re.Match[str]) -> str:
        path = match.group("path")
        code = (ROOT / path).read_text()
        assert "```" not in code, f"{path} holds a fence; it cannot be shown in one"
        return f"<!-- example: {path} -->\n```python\n{code.rstrip()}\n```"

    return _BLOCK.sub(block, markdown)


def test_the_page_shows_each_examples_code_as_the_file_holds_it() -> None:
    page = PAGE.read_text()
    assert "--8<--" not in page
    assert page == inlined(page), (
        "docs/examples.md differs from the example files: "
        "run python tests/unit/test_examples_doc.py"
    )


def test_every_example_file_is_on_the_page_once() -> None:
    shown = [match.group("path") for match in _BLOCK.finditer(PAGE.read_text())]
    assert sorted(shown) == example_files()


if __name__ == "__main__":
    PAGE.write_text(inlined(PAGE.read_text()))
    sys.exit(0)
