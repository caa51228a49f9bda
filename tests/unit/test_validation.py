"""The naming rules and value limits, checked without a database."""

from __future__ import annotations

import math

import pytest

from sqlalchemy_pgtask.errors import InvalidNameError, InvalidOptionError, PayloadError
from sqlalchemy_pgtask.validation import (
    HEADERS_MAX_BYTES,
    PAYLOAD_MAX_BYTES,
    check_idempotency_key,
    check_int_range,
    check_queue_name,
    check_seconds,
    check_task_name,
    dump_headers,
    dump_json,
)


@pytest.mark.parametrize("name", ["a", "send-email", "billing.v2:refund_1", "A" * 255])
def test_valid_task_names_pass(name: str) -> None:
    assert check_task_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "has space", "naïve", "semi;colon", "a/b", "A" * 256, "nul\x00"]
)
def test_invalid_task_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidNameError):
        check_task_name(name)


def test_queue_names_are_limited_to_128_bytes() -> None:
    assert check_queue_name("q" * 128) == "q" * 128
    with pytest.raises(InvalidNameError, match="128"):
        check_queue_name("q" * 129)


def test_non_string_names_are_rejected() -> None:
    with pytest.raises(InvalidNameError, match="must be a str"):
        check_task_name(42)


def test_idempotency_keys_allow_free_text_but_no_nul_and_bounded_size() -> None:
    assert check_idempotency_key("order 42 / refund é") == "order 42 / refund é"
    with pytest.raises(InvalidNameError, match="NUL"):
        check_idempotency_key("a\x00b")
    with pytest.raises(InvalidNameError, match="512"):
        check_idempotency_key("é" * 257)  # 514 bytes
    with pytest.raises(InvalidNameError, match="empty"):
        check_idempotency_key("")


def test_json_uses_postgres_jsonb_separators_and_utf8_size() -> None:
    assert dump_json("payload", {"a": [1, 2], "b": "é"}, 100) == '{"a": [1, 2], "b": "é"}'


def test_payload_at_limit_passes_and_one_byte_more_fails() -> None:
    overhead = len('""')
    exact = "x" * (PAYLOAD_MAX_BYTES - overhead)
    assert len(dump_json("payload", exact, PAYLOAD_MAX_BYTES)) == PAYLOAD_MAX_BYTES
    with pytest.raises(PayloadError, match="limit"):
        dump_json("payload", exact + "x", PAYLOAD_MAX_BYTES)


@pytest.mark.parametrize("value", [{1, 2}, object(), math.nan, math.inf, b"bytes"])
def test_non_json_values_are_rejected(value: object) -> None:
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        dump_json("payload", value, PAYLOAD_MAX_BYTES)


@pytest.mark.parametrize(
    "value", ["a\x00b", {"k": ["ok", "bad\x00"]}, {"bad\x00key": 1}]
)
def test_nul_characters_are_rejected_with_their_location(value: object) -> None:
    with pytest.raises(PayloadError, match="NUL"):
        dump_json("payload", value, PAYLOAD_MAX_BYTES)


def test_an_escaped_backslash_before_u0000_is_not_a_nul() -> None:
    assert dump_json("payload", "\\u0000", 100) == '"\\\\u0000"'


def test_headers_must_be_an_object_with_string_keys_within_64_kib() -> None:
    assert dump_headers(None) == "{}"
    assert dump_headers({"traceparent": "00-abc"}) == '{"traceparent": "00-abc"}'
    with pytest.raises(PayloadError, match="mapping"):
        dump_headers(["not", "an", "object"])
    with pytest.raises(PayloadError, match="keys must be str"):
        dump_headers({1: "x"})
    with pytest.raises(PayloadError, match="limit"):
        dump_headers({"big": "x" * HEADERS_MAX_BYTES})


def test_int_ranges_reject_bools_and_out_of_range_values() -> None:
    assert check_int_range("max_attempts", 1, 1, 10) == 1
    with pytest.raises(InvalidOptionError, match="between 1 and 10"):
        check_int_range("max_attempts", 0, 1, 10)
    with pytest.raises(InvalidOptionError, match="must be an int"):
        check_int_range("max_attempts", True, 1, 10)


def test_seconds_must_be_finite_and_not_negative() -> None:
    assert check_seconds("delay", 1) == 1.0
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(InvalidOptionError):
            check_seconds("delay", bad)
