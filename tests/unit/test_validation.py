"""The naming rules and value limits, checked without a database."""

from __future__ import annotations

import json
import math
import random
import sys
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

from sqlalchemy_pgtask.enqueue.plan import EnqueueRequest, new_ids, validate_request
from sqlalchemy_pgtask.errors import (
    InvalidNameError,
    InvalidOptionError,
    PayloadError,
    ValidationError,
)
from sqlalchemy_pgtask.validation import (
    DURATION_MAX_SECONDS,
    HEADERS_MAX_BYTES,
    PAYLOAD_MAX_BYTES,
    check_delay,
    check_idempotency_key,
    check_int_range,
    check_poll_interval,
    check_queue_name,
    check_run_at,
    check_seconds,
    check_task_name,
    check_timeout,
    dump_headers,
    dump_json,
    jsonb_text_size,
)


@pytest.mark.parametrize("name", ["a", "send-email", "billing.v2:refund_1", "A" * 255])
def test_valid_task_names_pass(name: str) -> None:
    assert check_task_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "has space", "naïve", "semi;colon", "a/b", "A" * 256, "nul\x00", "send\n", "\n",
     "a\nb", "a\r"],
)
def test_invalid_task_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidNameError):
        check_task_name(name)


def test_a_trailing_newline_is_not_part_of_a_valid_name() -> None:
    # re.match with "$" accepts "emails\n"; the database's POSIX regex CHECK does not.
    with pytest.raises(InvalidNameError, match="may only contain"):
        check_queue_name("emails\n")


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


@pytest.mark.parametrize("key", ["\ud800", "order-\udfff", "\udc80abc"])
def test_idempotency_keys_must_be_valid_utf8(key: str) -> None:
    with pytest.raises(InvalidNameError, match="not valid UTF-8") as caught:
        check_idempotency_key(key)
    assert caught.value.field == "idempotency_key"
    assert check_idempotency_key("emoji 😀") == "emoji 😀"  # a proper pair is fine


def test_json_uses_postgres_jsonb_separators_and_utf8_size() -> None:
    assert dump_json("payload", {"a": [1, 2], "b": "é"}, 100) == '{"a": [1, 2], "b": "é"}'


def test_payload_at_limit_passes_and_one_byte_more_fails() -> None:
    overhead = len('""')
    exact = "x" * (PAYLOAD_MAX_BYTES - overhead)
    assert len(dump_json("payload", exact, PAYLOAD_MAX_BYTES)) == PAYLOAD_MAX_BYTES
    with pytest.raises(PayloadError, match="limit"):
        dump_json("payload", exact + "x", PAYLOAD_MAX_BYTES)


SCALARS: list[object] = [
    None, True, False, 0, -7, 2**64, -(10**40), 0.0, -0.0, 1.5, 1e300, 1.5e-07, 5e-324,
    1764760000.123456, sys.float_info.max,
]


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_scalars_are_written_as_the_json_encoder_writes_them(value: object) -> None:
    # Scalars skip the encoder's set-up per call; the text must not change.
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
    assert dump_json("result", value, PAYLOAD_MAX_BYTES) == encoder.encode(value)
    assert dump_json("result", [value], PAYLOAD_MAX_BYTES) == encoder.encode([value])


def test_a_scalar_is_measured_as_jsonb_writes_it() -> None:
    # 1e+300 is 301 bytes once jsonb writes it out: over a limit its repr fits in.
    with pytest.raises(PayloadError, match="301 bytes"):
        dump_json("result", 1e300, 300)
    assert dump_json("result", 1e300, 301) == "1e+300"
    with pytest.raises(PayloadError, match="20 bytes"):
        dump_json("result", -(10**18), 19)


def test_an_int_too_long_to_print_is_rejected_as_not_serialisable() -> None:
    digits = sys.get_int_max_str_digits()
    if not digits:
        pytest.skip("this interpreter prints ints of any length")
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        dump_json("result", 10 ** (digits + 1), PAYLOAD_MAX_BYTES)


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


def test_a_nul_at_any_depth_is_a_payload_error_never_a_recursion_error() -> None:
    # The NUL walk takes a Python frame per level where the C encoder takes none: a value just
    # shallow enough to encode raised a bare RecursionError from the walk. Every depth around
    # the recursion limit is tried, wherever this test's own stack puts the window.
    limit = sys.getrecursionlimit()
    value: object = "\x00"
    for depth in range(1, limit + 50):
        value = [value]
        if depth < limit - 200:
            continue
        with pytest.raises(PayloadError, match=r"NUL|nested too deeply"):
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


# -- sizes as jsonb measures them ----------------------------------------------------------


def jsonb_number(text: str) -> str:
    """``numeric``'s text for a JSON number: every digit written out, no sign on zero."""
    number = Decimal(text)
    return format(number if number else abs(number), "f")


def jsonb_text(value: Any) -> str:
    """What PostgreSQL prints for ``value::jsonb``, up to key order (which keeps the size)."""
    if isinstance(value, float):
        return jsonb_number(repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(jsonb_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(
            f"{json.dumps(key, ensure_ascii=False)}: {jsonb_text(item)}"
            for key, item in value.items()
        ) + "}"
    return json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (1e300, 301),  # '1' and 300 zeros
        (1e-300, 302),  # '0.' then 299 zeros and '1'
        (-1e16, 18),
        (1.5e-07, 10),  # 0.00000015
        (5e-324, 326),
        (sys.float_info.max, 309),
        (1e15, len("1000000000000000.0")),  # repr has no exponent: unchanged
        (0.0001, 6),
    ],
)
def test_floats_are_counted_as_jsonb_writes_them_out(value: float, size: int) -> None:
    assert jsonb_text_size(json.dumps(value)) == size


@pytest.mark.parametrize(
    "value",
    [
        "1e+300",
        {"1e+300": "2.5e-07", "n": [1e300, "x\"1e+9\"", -2.5e-7]},
        ["\\", 1e+22, "\\\"e-5", {"k": 3e-05}],
        {"é": 1e100, "ü\"": "1e-100"},
    ],
    ids=["string-only", "strings-and-numbers", "escaped-quotes", "non-ascii-keys"],
)
def test_text_inside_strings_is_never_read_as_a_number(value: Any) -> None:
    text = json.dumps(value, ensure_ascii=False)
    assert jsonb_text_size(text) == len(jsonb_text(value).encode())


def test_random_floats_of_every_magnitude_are_counted_exactly() -> None:
    rng = random.Random(20260601)
    values = [
        rng.choice((-1, 1)) * rng.random() * 10.0 ** rng.randint(-330, 308)
        for _ in range(2000)
    ]
    values += [rng.uniform(-1e6, 1e6) for _ in range(200)]
    values = [value or 0.0 for value in values]  # -0.0 has its own test below
    for value in values:
        assert jsonb_text_size(json.dumps(value)) == len(jsonb_number(repr(value))), value
    assert jsonb_text_size(json.dumps(values)) == len(jsonb_text(values))
    # jsonb drops the sign of -0.0: counted one byte high, which can only be safe.
    assert jsonb_text_size("-0.0") == len(jsonb_number("-0.0")) + 1


def test_a_payload_at_the_limit_as_jsonb_passes_and_one_byte_more_fails() -> None:
    # JSON text '["xx...x", 1e+300]' is 12 bytes plus the padding; jsonb's is 307 plus it.
    exact = ["x" * (PAYLOAD_MAX_BYTES - 307), 1e300]
    assert jsonb_text_size(dump_json("payload", exact, PAYLOAD_MAX_BYTES)) == PAYLOAD_MAX_BYTES
    with pytest.raises(PayloadError, match="as jsonb text") as caught:
        dump_json("payload", ["x" * (PAYLOAD_MAX_BYTES - 306), 1e300], PAYLOAD_MAX_BYTES)
    assert caught.value.field == "payload"


@pytest.mark.parametrize("decoy", ["e-1 e+2", "type-2e-5", "x" * 10_000 + "e-9"])
def test_a_float_in_exponent_form_is_counted_after_text_that_looks_like_one(decoy: str) -> None:
    # The search for exponents starts from an "e" and its sign: a string holding such runs,
    # before the real float, must not end it.
    plain = dump_json("payload", [decoy, 1.0], PAYLOAD_MAX_BYTES)
    exponent = dump_json("payload", [decoy, 1e300], PAYLOAD_MAX_BYTES)
    assert jsonb_text_size(plain) == len(plain)
    assert jsonb_text_size(exponent) == len(exponent) - len("1e+300") + 301


# -- durations and times -------------------------------------------------------------------


def test_durations_are_bounded_at_100_years() -> None:
    assert check_seconds("delay", DURATION_MAX_SECONDS) == DURATION_MAX_SECONDS
    for bad in (DURATION_MAX_SECONDS + 1, 1e300, sys.float_info.max, 10**400):
        with pytest.raises(InvalidOptionError, match="100 years"):
            check_seconds("delay", bad)


def test_delays_accept_seconds_and_timedeltas_within_the_bound() -> None:
    assert check_delay("delay", timedelta(days=1)) == 86400.0
    assert check_delay("delay", 2) == 2.0
    for bad in (timedelta.max, timedelta(days=36525, seconds=1), timedelta(seconds=-1)):
        with pytest.raises(InvalidOptionError) as caught:
            check_delay("delay", bad)
        assert caught.value.field == "delay"


@pytest.mark.parametrize(
    "run_at",
    [
        datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))),  # year 0 in UTC
        datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5))),  # year 10000 in UTC
    ],
)
def test_run_at_must_be_readable_back_in_utc(run_at: datetime) -> None:
    with pytest.raises(InvalidOptionError, match="outside years 1 to 9999 in UTC"):
        check_run_at("run_at", run_at)


def test_run_at_at_the_edges_of_the_utc_range_is_accepted() -> None:
    earliest = datetime(1, 1, 1, 5, tzinfo=timezone(timedelta(hours=5)))
    latest = datetime(9999, 12, 31, 18, 59, tzinfo=timezone(timedelta(hours=-5)))
    assert check_run_at("run_at", earliest) == datetime(1, 1, 1, tzinfo=timezone.utc)
    assert check_run_at("run_at", latest) == datetime(9999, 12, 31, 23, 59, tzinfo=timezone.utc)
    # In UTC: the instant, whatever offset or fold named it.
    assert check_run_at("run_at", latest).utcoffset() == timedelta(0)
    with pytest.raises(InvalidOptionError, match="timezone-aware"):
        check_run_at("run_at", datetime(2030, 1, 1))


def test_wait_timeouts_and_poll_intervals() -> None:
    assert check_timeout("timeout", None) is None
    assert check_timeout("timeout", 0) == 0.0
    assert check_timeout("timeout", math.inf) == math.inf  # waits for ever, like None
    for bad in (math.nan, -1, "5", True):
        with pytest.raises(InvalidOptionError):
            check_timeout("timeout", bad)
    assert check_poll_interval("poll_interval", 0.05) == 0.05
    for wrong in (0, -1, math.nan, math.inf, "1", None, False):
        with pytest.raises(InvalidOptionError):
            check_poll_interval("poll_interval", wrong)


def test_an_oversize_payload_with_an_unpaired_surrogate_is_reported_as_too_large() -> None:
    # The size is checked before the encoding: both are wrong, and the size is named.
    with pytest.raises(PayloadError, match="bytes as jsonb text; the limit is"):
        dump_json("payload", "\udc80" + "x" * PAYLOAD_MAX_BYTES, PAYLOAD_MAX_BYTES)
    with pytest.raises(PayloadError, match="unpaired surrogate"):
        dump_json("payload", "\udc80" + "x" * 10, PAYLOAD_MAX_BYTES)


#: Each request's field and every field checked after it are bad; the first one must be named.
_BAD_FROM: list[tuple[str, dict[str, Any]]] = [
    ("name", {"name": ""}),
    ("queue", {"queue": ""}),
    ("version", {"version": 0}),
    ("priority", {"priority": 70_000}),
    ("max_attempts", {"max_attempts": 0}),
    ("idempotency_key", {"idempotency_key": "a\x00b"}),
    ("run_at", {"run_at": datetime(2030, 1, 1, tzinfo=timezone.utc), "delay": 1.0}),
    ("delay", {"delay": -1.0}),
    ("payload", {"payload": object()}),
    ("headers", {"headers": ["not", "a", "mapping"]}),
    ("timeout", {"timeout": -1.0}),
]


@pytest.mark.parametrize("first", range(len(_BAD_FROM)), ids=[f for f, _ in _BAD_FROM])
def test_a_request_with_several_bad_fields_names_the_first_in_the_documented_order(
    first: int,
) -> None:
    fields: dict[str, Any] = {"name": "ok"}
    for _, bad in _BAD_FROM[first:]:
        fields.update(bad)
    with pytest.raises(ValidationError) as caught:
        validate_request(EnqueueRequest(**fields), new_ids(1)[0], prefix="[3].")
    assert caught.value.field == f"[3].{_BAD_FROM[first][0]}"
