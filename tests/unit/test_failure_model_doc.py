"""docs/failure-model.md names, for every guarantee, the tests that show it: they must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "failure-model.md"
#: ```path/to/test_file.py::test_name``` or a following ```::test_name``` in the same file.
_REFERENCE = re.compile(
    r"`(?:((?:unit|integration|acceptance|migrations)/[\w/]+\.py))?::(test_\w+)`"
)


def test_every_test_the_failure_model_names_exists() -> None:
    current: str | None = None
    named, missing = 0, []
    for match in _REFERENCE.finditer(DOC.read_text()):
        current = match.group(1) or current
        assert current is not None, f"{match.group(0)} names no file before it"
        source = ROOT / "tests" / current
        named += 1
        if not source.exists() or f"def {match.group(2)}(" not in source.read_text():
            missing.append(f"{current}::{match.group(2)}")
    assert named > 50
    assert missing == []
