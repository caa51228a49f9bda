"""`EnqueueRequest` is a frozen, keyword-only dataclass whose ``__init__`` is written by hand
(for speed: see its comment); the hand-written one must accept exactly the fields, with
exactly their defaults, or a field added later would be silently left out."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from datetime import timedelta

import pytest

from sqlalchemy_pgtask import EnqueueRequest


def test_init_takes_exactly_the_fields_keyword_only_with_their_defaults() -> None:
    parameters = list(inspect.signature(EnqueueRequest.__init__).parameters.values())[1:]
    fields = dataclasses.fields(EnqueueRequest)
    assert [p.name for p in parameters] == [f.name for f in fields]
    for parameter, field in zip(parameters, fields, strict=True):
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, parameter
        missing = field.default is dataclasses.MISSING
        expected = inspect.Parameter.empty if missing else field.default
        assert parameter.default == expected, parameter.name


def test_every_argument_lands_in_its_field() -> None:
    values = {
        "name": "emails.send", "payload": {"to": "a@example.com"}, "queue": "emails",
        "version": 3, "run_at": None, "delay": timedelta(seconds=5), "priority": -2,
        "max_attempts": 4, "idempotency_key": "order-1", "headers": {"trace": "t"},
        "timeout": 9.5, "concurrency_key": "customer-1", "concurrency_limit": 2,
    }
    request = EnqueueRequest(**values)  # type: ignore[arg-type]
    assert dataclasses.asdict(request) == values
    assert [f.name for f in dataclasses.fields(EnqueueRequest)] == list(values)


def test_a_request_is_frozen_comparable_hashable_replaceable_and_picklable() -> None:
    request = EnqueueRequest(name="reports.build", payload=[1, 2], queue="reports")
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.queue = "other"  # type: ignore[misc]
    same = EnqueueRequest(name="reports.build", payload=[1, 2], queue="reports")
    assert request == same
    assert hash(EnqueueRequest(name="a")) == hash(EnqueueRequest(name="a"))
    moved = dataclasses.replace(request, queue="other", priority=5)
    assert (moved.queue, moved.priority, moved.payload) == ("other", 5, [1, 2])
    assert request.queue == "reports"
    assert pickle.loads(pickle.dumps(request)) == request
    assert repr(request).startswith("EnqueueRequest(name='reports.build', payload=[1, 2]")


def test_a_missing_name_an_unknown_argument_and_a_positional_one_are_type_errors() -> None:
    with pytest.raises(TypeError):
        EnqueueRequest()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        EnqueueRequest(name="a", priorty=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        EnqueueRequest("a")  # type: ignore[call-arg]
