"""The payload encoder writes exactly what ``json.JSONEncoder`` writes, errors included.

`sqlalchemy_pgtask._json_text.encode` keeps one C encoder without the circular-reference
check instead of building one per call; whatever it cannot encode is handed to the standard
encoder, so the caller sees the standard text and the standard error.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
from collections import OrderedDict
from typing import Any

import pytest

from sqlalchemy_pgtask import _json_text
from sqlalchemy_pgtask.errors import PayloadError
from sqlalchemy_pgtask.validation import PAYLOAD_MAX_BYTES, dump_json

STANDARD = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randrange(-(2**70), 2**70)
    if kind == 3:
        return rng.choice([rng.random() * 10 ** rng.randrange(-320, 300), -0.0, 5e-324])
    if kind in (4, 5):
        alphabet = "ab\"\\/\n\t\x01\x7f é€\u2028😀"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(8)))
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(3)))
    return {
        rng.choice(["k", "é", "\"q\"", "1", ""]) + str(i): random_value(rng, depth + 1)
        for i in range(rng.randrange(4))
    }


def test_this_interpreter_uses_the_prebuilt_c_encoder() -> None:
    # Otherwise the comparisons below compare the standard encoder with itself.
    if json.encoder.c_make_encoder is None:  # type: ignore[attr-defined]
        pytest.skip("this Python's json has no C encoder")
    assert _json_text.encode != STANDARD.encode


def test_random_documents_are_written_exactly_as_the_standard_encoder_writes_them() -> None:
    rng = random.Random(20261203)
    for _ in range(3000):
        value = random_value(rng)
        assert _json_text.encode(value) == STANDARD.encode(value), value


@pytest.mark.parametrize(
    "value",
    [OrderedDict(b=1, a=2), {1: "int key", 2.5: "float key", False: "bool", None: "null"},
     "top-level text", 7, 1e300, [math.pi], {"nested": {"deeper": [[], {}]}}],
    ids=repr,
)
def test_mappings_keys_and_top_level_values_are_written_as_the_standard_encoder_does(
    value: object,
) -> None:
    assert _json_text.encode(value) == STANDARD.encode(value)


def circular() -> list[object]:
    loop: list[object] = []
    loop.append({"again": loop})
    return loop


@pytest.mark.parametrize(
    "make",
    [lambda: math.nan, lambda: [math.inf], lambda: {"x": object()}, lambda: {(1, 2): 3},
     circular],
    ids=["nan", "infinity", "an-object", "a-tuple-key", "a-cycle"],
)
def test_what_the_standard_encoder_refuses_is_refused_with_its_error(make: Any) -> None:
    with pytest.raises((ValueError, TypeError)) as standard:
        STANDARD.encode(make())
    with pytest.raises(type(standard.value)) as ours:
        _json_text.encode(make())
    assert str(ours.value) == str(standard.value)


def test_a_cycle_is_reported_as_a_cycle_by_validation() -> None:
    with pytest.raises(PayloadError, match="Circular reference detected"):
        dump_json("payload", circular(), PAYLOAD_MAX_BYTES)


def test_a_document_nested_past_the_recursion_limit_is_reported_as_too_deep() -> None:
    deep: list[object] = []
    for _ in range(sys.getrecursionlimit() + 100):
        deep = [deep]
    with pytest.raises(PayloadError, match="nested too deeply"):
        dump_json("payload", deep, PAYLOAD_MAX_BYTES)


def test_threads_encoding_one_shared_document_all_get_its_text() -> None:
    # Without a shared markers dict no thread can see another's work as a cycle.
    shared = OrderedDict((f"k{i}", [i, {"v": "x" * i}]) for i in range(200))
    expected = STANDARD.encode(shared)
    texts: list[str] = []
    failures: list[BaseException] = []
    start = threading.Barrier(4)

    def encode_many() -> None:
        start.wait()
        try:
            texts.extend(_json_text.encode(shared) for _ in range(300))
        except BaseException as exc:  # reported below, with the others
            failures.append(exc)

    threads = [threading.Thread(target=encode_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert texts == [expected] * 1200


def test_without_a_c_encoder_the_standard_one_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    assert _json_text._fast_encoder() is None


def test_a_c_encoder_of_another_signature_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def other(*args: object) -> object:
        raise TypeError(f"expected 10 arguments, got {len(args)}")

    monkeypatch.setattr(json.encoder, "c_make_encoder", other)
    assert _json_text._fast_encoder() is None


def test_a_c_encoder_that_writes_other_text_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def compact(*args: object) -> object:
        return lambda value, level: (json.dumps(value, separators=(",", ":")),)

    monkeypatch.setattr(json.encoder, "c_make_encoder", compact)
    assert _json_text._fast_encoder() is None
