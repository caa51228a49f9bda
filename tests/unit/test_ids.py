"""Task ids are RFC 9562 version 7 UUIDs: unique, and ordered by creation time."""

from __future__ import annotations

import pickle
import time
import uuid

import pytest

from sqlalchemy_pgtask import _ids
from sqlalchemy_pgtask.enqueue.plan import new_ids as _uuid7s


def test_ids_are_version_7_with_the_rfc_variant() -> None:
    for task_id in _uuid7s(100):
        assert task_id.version == 7
        assert task_id.variant == "specified in RFC 4122"


def test_ids_are_unique_within_and_across_batches() -> None:
    ids = _uuid7s(10_000) + _uuid7s(10_000)
    assert len(set(ids)) == 20_000


def test_later_batches_sort_after_earlier_ones() -> None:
    first = _uuid7s(5)
    deadline = time.monotonic() + 1.0
    while time.time_ns() // 1_000_000 == first[0].int >> 80 and time.monotonic() < deadline:
        pass  # the embedded timestamp has millisecond resolution: wait for the next one
    second = _uuid7s(5)
    assert max(first) < min(second)


def test_the_timestamp_is_the_current_unix_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    stamp = _uuid7s(1)[0].int >> 80
    after = time.time_ns() // 1_000_000
    assert before <= stamp <= after


def test_ids_are_uuids_in_every_respect_of_the_constructors_own() -> None:
    for task_id in _uuid7s(50):
        built = uuid.UUID(int=task_id.int)
        assert type(task_id) is uuid.UUID
        assert task_id == built
        assert hash(task_id) == hash(built)
        assert str(task_id) == str(built)
        assert task_id.bytes == built.bytes
        assert task_id.is_safe is built.is_safe
        assert pickle.loads(pickle.dumps(task_id)) == built
        assert uuid.UUID(str(task_id)) == task_id


def test_a_python_whose_uuid_cannot_be_built_directly_gets_the_constructor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def laid_out_otherwise(value: int) -> uuid.UUID:
        raise AttributeError("'UUID' object has no attribute 'int'")

    monkeypatch.setattr(_ids, "_uuid_from_int", laid_out_otherwise)
    make = _ids._id_maker()
    assert make is not laid_out_otherwise
    assert make(12345) == uuid.UUID(int=12345)
