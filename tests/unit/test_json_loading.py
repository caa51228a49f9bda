"""The worker's JSON decoder gives what ``json.loads`` gives for the text PostgreSQL sends."""

from __future__ import annotations

import json
from typing import cast

import pytest

from sqlalchemy_pgtask.worker._reconnect import load_json, owned_engine

TEXTS = [
    "{}", "[]", "null", "true", "0", "-0.0", "1e+300", "12345678901234567890123",
    '{"i": 12345}', '{"a": [1, 2.5, null, true, false], "b": {"c": "d"}}',
    '"naïve café ☕ 𝄞 日本語"', '"\\ud83d\\ude00 and \\u00e9 escaped"',
    '{"line": "a\\nb\\t\\"q\\" \\\\"}', '  {"spaced" :  [ 1 , 2 ] }  ',
    '{"trailing": 1}  \n', '[1, 2]\t',
]


@pytest.mark.parametrize("text", TEXTS)
def test_decodes_utf8_bytes_as_json_loads(text: str) -> None:
    data = text.encode()
    assert load_json(data) == json.loads(data)
    assert repr(load_json(data)) == repr(json.loads(data))  # -0.0, int against float


@pytest.mark.parametrize("data", [b"", b"{", b'{"a": 1} x', b"1 2", b"  [1,", b"NaN-ish"])
def test_refuses_what_json_loads_refuses(data: bytes) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(data)
    with pytest.raises(json.JSONDecodeError):
        load_json(data)


def test_the_engine_a_worker_makes_from_a_url_decodes_json_with_it() -> None:
    # Without this the integration tests would still pass: json.loads gives the same values.
    engine = owned_engine("postgresql://app@db.invalid/app")
    try:
        # SQLAlchemy types it as taking str; psycopg, which calls it, hands over bytes.
        assert cast(object, engine.dialect._json_deserializer) is load_json
        assert engine.dialect.driver == "psycopg"
    finally:
        engine.sync_engine.dispose()
