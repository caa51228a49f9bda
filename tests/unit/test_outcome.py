"""Outcome documents: an error always fits its column, a bad result becomes a terminal error.

Pure functions, no database. That PostgreSQL's ``jsonb`` accepts these documents (NUL and
unpaired surrogates included) is proven against a real server in
``tests/integration/test_fencing.py`` and end to end in ``tests/integration/test_worker.py``.
"""

from __future__ import annotations

import json
import sys
import traceback
from decimal import Decimal
from typing import Any

import pytest

from sqlalchemy_pgtask.outcome import error_document, one_line, result_document

ERROR_MAX_BYTES = 256 * 1024
RESULT_MAX_BYTES = 1024 * 1024
TEN_MB = 10 * 1024 * 1024


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a real traceback attached, as a handler's exception has."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def size(document: str) -> int:
    return len(document.encode("utf-8"))


def jsonb_safe(document: str) -> None:
    """What PostgreSQL's jsonb input needs: valid UTF-8 and no ``\\u0000`` escape."""
    document.encode("utf-8")  # raises on an unpaired surrogate
    assert "\\u0000" not in document
    assert "\x00" not in document
    json.loads(document)


# -- error documents -----------------------------------------------------------------------


def test_error_document_carries_kind_exception_message_and_traceback() -> None:
    document = json.loads(error_document("handler_error", raised(KeyError("order 42"))))
    assert document["type"] == "handler_error"
    assert document["exception"] == "KeyError"
    assert document["message"] == "'order 42'"
    assert document["traceback"].startswith("Traceback (most recent call last):")
    assert "KeyError: 'order 42'" in document["traceback"]
    assert "message_truncated" not in document
    assert "traceback_truncated" not in document


class PaymentDeclined(Exception):
    pass


def test_error_document_names_non_builtin_exceptions_with_their_module() -> None:
    document = json.loads(error_document("fail", raised(PaymentDeclined("card"))))
    assert document["exception"] == f"{__name__}.PaymentDeclined"


def test_error_document_without_exception_is_just_the_kind_and_fields() -> None:
    assert json.loads(error_document("cancelled")) == {"type": "cancelled"}
    assert json.loads(error_document("result_rejected", reason="too big")) == {
        "type": "result_rejected", "reason": "too big",
    }


#: One character repeated into a 10 MB message: ASCII, multi-byte UTF-8, characters that
#: PostgreSQL's jsonb refuses (NUL, unpaired surrogates) and characters that JSON escaping
#: inflates (two bytes for a backslash or a quote, six for a control character).
_UNITS = {
    "ascii": "a", "two-byte": "\u00e9", "four-byte": "\U0001f600", "nul": "\x00",
    "lone-surrogate": "\udc80", "newlines": "line\n", "backslash": "\\", "quote": '"',
    "control": "\x01",
}


@pytest.mark.parametrize("unit", list(_UNITS.values()), ids=list(_UNITS))
def test_error_document_fits_256_kib_even_for_a_10_mb_message(unit: str) -> None:
    # The message is in the traceback's last line too, so both are 10 MB here.
    exc = raised(RuntimeError("boom:" + unit * (TEN_MB // len(unit))))
    document_text = error_document("handler_error", exc)
    assert size(document_text) <= ERROR_MAX_BYTES
    jsonb_safe(document_text)
    document = json.loads(document_text)
    assert document["type"] == "handler_error"
    # Truncated, it keeps the exception and the start of the message, and says so.
    assert document["exception"] == "RuntimeError"
    assert document["message"].startswith("boom:")
    assert len(document["message"]) <= 16 * 1024
    assert document["message_truncated"] is True
    # The end of the traceback is kept: the innermost frame says where it failed.
    assert document["traceback_truncated"] is True
    assert document["traceback"].startswith("...(truncated)\n")
    assert "Traceback (most recent call last)" not in document["traceback"]


def long_chain(links: int) -> BaseException:
    """An exception raised from ``links`` earlier ones: a traceback of distinct frames."""
    exc: BaseException | None = None
    for index in range(links):
        try:
            raise LookupError(f"link {index} " + "x" * 100) from exc
        except LookupError as caught:
            exc = caught
    assert exc is not None
    return exc


def test_a_huge_traceback_is_cut_from_the_front_keeping_the_innermost_frames() -> None:
    exc = long_chain(3000)
    full = "".join(traceback.format_exception(exc))
    assert len(full.encode()) > ERROR_MAX_BYTES  # the case under test
    document_text = error_document("handler_error", exc)
    assert size(document_text) <= ERROR_MAX_BYTES
    document = json.loads(document_text)
    assert document["traceback_truncated"] is True
    assert "message_truncated" not in document
    assert document["message"].startswith("link 2999 ")
    assert document["traceback"].rstrip().endswith(document["message"])
    assert "link 0 " not in document["traceback"]


def test_nul_and_lone_surrogates_in_a_message_are_replaced_not_dropped() -> None:
    exc = raised(ValueError("before\x00middle\udc80after"))
    document_text = error_document("handler_error", exc)
    jsonb_safe(document_text)
    message = json.loads(document_text)["message"]
    assert message.startswith("before")
    assert message.endswith("after")
    assert "middle" in message
    assert "\x00" not in message
    assert "\udc80" not in message


def test_error_documents_from_exceptions_that_carry_bytes_are_json() -> None:
    exc = raised(ValueError(b"\x00\xff binary"))
    jsonb_safe(error_document("handler_error", exc))


# -- result documents ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [None, 0, -1.5, True, "text", [1, "two", None], {"nested": {"list": [1, 2, 3]}},
     "\u00e9\U0001f600"],
)
def test_result_document_accepts_json_values_and_serialises_them_once(value: Any) -> None:
    result, error = result_document(value)
    assert error is None
    assert result is not None
    assert json.loads(result) == value


def rejected(value: object) -> dict[str, Any]:
    result, error = result_document(value)
    assert result is None
    assert error is not None
    assert size(error) <= ERROR_MAX_BYTES
    jsonb_safe(error)
    document: dict[str, Any] = json.loads(error)
    assert document["type"] == "result_rejected"
    assert isinstance(document["reason"], str)
    return document


@pytest.mark.parametrize(
    "value",
    [{1, 2}, object(), Decimal("1.5"), b"bytes", {"k": {"deeper": object()}}, {(1, 2): 3},
     float("nan"), float("inf"), [float("-inf")]],
    ids=["set", "object", "decimal", "bytes", "nested-object", "tuple-key", "nan", "inf",
         "nested-inf"],
)
def test_non_json_results_are_rejected_with_kind_result_rejected(value: object) -> None:
    document = rejected(value)
    assert "JSON" in document["reason"]


def test_a_result_over_one_mib_is_rejected() -> None:
    document = rejected("x" * RESULT_MAX_BYTES)  # plus two quotes
    assert str(RESULT_MAX_BYTES) in document["reason"]


def test_a_result_of_exactly_one_mib_as_json_is_accepted() -> None:
    result, error = result_document("x" * (RESULT_MAX_BYTES - 2))
    assert error is None
    assert result is not None
    assert size(result) == RESULT_MAX_BYTES


def test_the_size_limit_counts_utf8_bytes_not_characters() -> None:
    # 300 Ki four-byte characters: 1.2 MiB as UTF-8, though fewer than 1 Mi characters.
    rejected("\U0001f600" * (300 * 1024))


@pytest.mark.parametrize(
    "value", ["a\x00b", {"key": "\x00"}, {"a\x00": 1}, ["ok", ["\x00"]]],
    ids=["string", "value", "key", "nested-list"],
)
def test_results_holding_nul_are_rejected(value: object) -> None:
    document = rejected(value)
    assert "NUL" in document["reason"]


def test_results_holding_a_lone_surrogate_are_rejected() -> None:
    document = rejected({"text": "half \udc80 pair"})
    assert "surrogate" in document["reason"]


def test_a_circular_result_is_rejected() -> None:
    value: list[Any] = []
    value.append(value)
    rejected(value)


def test_a_too_deeply_nested_result_is_rejected_not_raised() -> None:
    value: list[Any] = []
    for _ in range(100_000):
        value = [value]
    rejected(value)


class UnprintableError(Exception):
    """An exception whose message formatting is itself broken (a common bug in user code)."""

    def __str__(self) -> str:
        raise TypeError("not enough arguments for format string")


def test_an_exception_whose_str_fails_still_yields_an_error_document() -> None:
    document_text = error_document("handler_error", raised(UnprintableError()))
    jsonb_safe(document_text)
    document = json.loads(document_text)
    assert document["exception"] == f"{__name__}.UnprintableError"
    assert "traceback" in document


class ExplodingList(list[int]):
    """A list whose iteration raises (a lazy collection that can no longer load)."""

    def __iter__(self) -> Any:
        raise RuntimeError("the collection can no longer load")


def test_a_result_whose_serialisation_raises_is_rejected_not_raised() -> None:
    document = rejected({"items": ExplodingList([1, 2])})
    assert "RuntimeError: the collection can no longer load" in document["reason"]


def test_a_result_with_a_nul_at_any_depth_is_rejected_not_raised() -> None:
    # The NUL scan takes a Python frame per level where the C encoder takes none (on Python
    # 3.12+ the encoder nests deeper still): a result just shallow enough to encode made the
    # scan raise RecursionError, and the attempt ended with no outcome written. Every depth
    # around the recursion limit is tried, wherever this test's own stack puts the window.
    limit = sys.getrecursionlimit()
    value: object = "\x00"
    for depth in range(1, limit + 50):
        value = [value]
        if depth >= limit - 200:
            assert "NUL" in rejected(value)["reason"] or "deep" in rejected(value)["reason"]


@pytest.mark.parametrize("module", ["generated\x00module", "generated\udc80module"],
                         ids=["nul", "lone-surrogate"])
def test_an_exception_class_with_an_unencodable_module_name_yields_a_jsonb_safe_document(
    module: str,
) -> None:
    class Oddly(Exception):
        pass

    Oddly.__module__ = module
    document_text = error_document("handler_error", raised(Oddly("fine")))
    jsonb_safe(document_text)
    document = json.loads(document_text)
    assert document["exception"].startswith("generated\\")
    assert document["exception"].endswith("Oddly")
    assert document["message"] == "fine"


def test_a_log_line_of_an_error_holds_no_control_character() -> None:
    # The worker logs a handler's error as one_line(exc): an escape sequence in the message
    # reached the log raw and drove the terminal of whoever read it.
    exc = RuntimeError("\x1b]0;pwned\x07\x1b[2Jcleared\x9b31m\x7f")
    line = one_line(exc)
    assert not [c for c in line if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F], line
    assert line == (
        "RuntimeError: \\u001b]0;pwned\\u0007\\u001b[2Jcleared\\u009b31m\\u007f"
    )
