"""_json_text: JSON text as PostgreSQL's ``jsonb`` prints it, for the size limits.

The size CHECKs measure ``octet_length(value::text)``, jsonb's own output: serialised with
the same separators, Python's text has the same size, except for floats in exponent form,
which ``numeric`` writes out in full. Pure functions, no I/O; `sqlalchemy_pgtask.validation`
applies them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["encode", "find_nul", "has_exponent", "jsonb_text_size", "scalar_text"]


def find_nul(value: Any, path: str) -> str | None:
    """Return the path of the first string holding NUL (PostgreSQL's jsonb rejects it)."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                return f"{path} key {key!r}"
            found = find_nul(item, f"{path}[{key!r}]")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = find_nul(item, f"{path}[{index}]")
            if found:
                return found
    return None


# A JSON string (escapes included), matched whole so nothing inside one is read as a number;
# or a number, whose groups are set when it has an exponent.
_JSON_TOKEN: Final = re.compile(
    r'"[^"\\]*(?:\\.[^"\\]*)*"'
    r"|(-?)(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?"
)
# Python writes a float in exponent form as "1e+300" or "1.5e-07": text without a
# digit-e-sign-digit run holds no such float, and skips the scan (the common case).
# Searched from the "e": a pattern that starts with a class is tried at every character
# (~130 us for a 10 KB payload), one that starts with a literal jumps between its matches.
_EXPONENT: Final = re.compile(r"e[+-]\d")


def has_exponent(text: str) -> bool:
    """Whether ``text`` (JSON) holds a number in exponent form."""
    if "e+" not in text and "e-" not in text:  # most payloads: no regex scan at all
        return False
    for match in _EXPONENT.finditer(text):
        at = match.start()
        if at and text[at - 1] in "0123456789":
            return True
    return False


def _numeric_text_length(sign: str, whole: str, fraction: str, exponent: int) -> int:
    """The length of PostgreSQL's ``numeric`` text for a JSON number in exponent form.

    ``numeric`` never prints an exponent: the digits are written out, with as many decimals
    as the input had minus the exponent (``1e300`` is 301 digits, ``1.5e-07`` is
    ``0.00000015``), and no sign on zero.
    """
    digits = whole + fraction
    significant = digits.lstrip("0")
    scale = max(0, len(fraction) - exponent)
    if significant:
        point = len(whole) + exponent  # digits before the decimal point, leading zeros included
        integer = max(1, point - (len(digits) - len(significant)))
    else:
        sign, integer = "", 1
    return len(sign) + integer + (1 + scale if scale else 0)


def jsonb_text_size(text: str) -> int:
    """The bytes of ``text`` once cast to ``jsonb`` and printed back, as the CHECKs measure.

    Serialised with PostgreSQL's separators, the text has the same size as jsonb's output,
    except for floats in exponent form, which jsonb writes out in full; those are counted
    exactly (by a scan that runs only when the text has one).
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if not has_exponent(text):
        return size
    for token in _JSON_TOKEN.finditer(text):
        sign, whole, fraction, exponent = token.groups()
        if exponent is not None:
            numeric = _numeric_text_length(sign, whole, fraction or "", int(exponent))
            size += numeric - len(token.group())
    return size


#: The encoder of record: PostgreSQL's separators, no NaN or infinity, text left unescaped.
_STANDARD: Final = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def _fast_encoder() -> Callable[[object], str] | None:
    """`_STANDARD`'s C encoder, built once and without its circular-reference check, if this
    Python has one that writes exactly what `_STANDARD` writes (else None).

    ``JSONEncoder.encode`` builds a C encoder and a markers dict on every call: about 60 % of
    encoding a small payload, which a bulk enqueue does for every task. Without markers a
    cyclic value recurses until `RecursionError`; any error falls back to `_STANDARD`, which
    raises exactly what it always did ("Circular reference detected", a NaN, a type).
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        chunks = make(
            None, _STANDARD.default, json.encoder.encode_basestring, None,
            _STANDARD.key_separator, _STANDARD.item_separator, False, False, False,
        )
        if "".join(chunks(_PROBE, 0)) != _STANDARD.encode(_PROBE):
            return None
    except Exception:  # a signature this code does not know: the standard encoder it is
        return None

    def encode(value: object) -> str:
        try:
            return "".join(chunks(value, 0))
        except Exception:
            return _STANDARD.encode(value)

    return encode


_PROBE: Final = {"a": [1, 2.5, -0.0, 1e300, None, True, False], "é\n": {"b": "x\u2028\"y"}}
#: Serialise ``value`` as `_STANDARD` does (the same text, the same errors).
encode: Final[Callable[[object], str]] = _fast_encoder() or _STANDARD.encode


def scalar_text(value: object) -> str | None:
    """``value``'s JSON text as the encoder writes it, if it is a plain scalar (else None).

    A handler's usual result is one: no encoder set-up, nor the scans a document needs (no NUL,
    surrogate or escape can be in it). Non-finite floats are left to the encoder, which refuses
    them. Raises ValueError for an int too long to print.
    """
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)
    return None
