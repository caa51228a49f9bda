"""A griffe extension for the API reference: reStructuredText literal blocks become fenced code.

The package's docstrings are reStructuredText (``help()`` and editors show them as written),
and mkdocstrings renders docstring text as Markdown, where a paragraph ending in ``::`` shows
the two colons and its indented block loses its highlighting. This extension rewrites each
docstring before it is rendered, as Sphinx reads them: ``Text::`` becomes ``Text:``, a ``::``
alone disappears, and the indented block after it becomes a fenced block (``python`` when it
parses as Python, ``text`` otherwise). mkdocs.yml loads it; the source stays unchanged.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import griffe

__all__ = ["LiteralBlocks", "fence_literal_blocks"]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(code: str) -> str:
    try:
        ast.parse(code)
    except SyntaxError:
        return "text"
    return "python"


def fence_literal_blocks(text: str) -> str:
    """``text`` with every ``::`` literal block written as a fenced code block."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::") or stripped.lstrip().startswith(".."):
            out.append(line)
            i += 1
            continue
        indent = _indent(line)
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        end = start
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        while end > start and not lines[end - 1].strip():
            end -= 1
        if end == start:  # no indented block follows: not a literal block
            out.append(line)
            i += 1
            continue
        lead = stripped[:-2]
        if lead.strip():
            # "Text::" reads "Text:"; "Text ::" reads "Text".
            out.append(lead.rstrip() if lead.endswith(" ") else lead + ":")
            out.append("")
        code = textwrap.dedent("\n".join(lines[start:end]))
        pad = " " * indent
        out.append(f"{pad}```{_language(code)}")
        out.extend(f"{pad}{row}" if row else "" for row in code.splitlines())
        out.append(f"{pad}```")
        i = end
    return "\n".join(out)


def _rewrite(obj: griffe.Object) -> None:
    docstring = obj.docstring
    if docstring is not None and "::" in docstring.value:
        docstring.value = fence_literal_blocks(docstring.value)
        docstring.__dict__.pop("parsed", None)  # parsed before the rewrite: parse again
    for member in obj.members.values():
        if not member.is_alias:  # an alias's target is rewritten where it is defined
            _rewrite(member)  # type: ignore[arg-type]


class LiteralBlocks(griffe.Extension):
    """Rewrites the docstrings of every object of a loaded package (see the module's
    docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg)
