"""benchmarks/enqueue_client.py: what a bulk enqueue costs the client before its ``COPY``,
part by part, each beside what it replaced (run on demand; no database; prints figures).

::

    .venv/bin/python benchmarks/enqueue_client.py [--batch N] [--rounds R]

For a batch of ``N`` requests (default 1,000) with ``run.py``'s small payloads it times, per
task, each step of ``enqueue_many`` that runs before anything is sent, and next to three of
them the standard way the library did the same until 2026-12-03:

* building the `EnqueueRequest` objects (the caller's work), against a frozen, keyword-only
  dataclass with the same fields and its generated ``__init__``;
* ``new_ids``, against the same ids made with ``uuid.UUID(int=...)``;
* serialising the payloads (``_json_text.encode``), against ``JSONEncoder.encode``;
* ``validate_many`` (ids, every check, the JSON) and ``plan_many``, in all.

Rounds interleave the variants, so a noisy host shakes them alike; it prints the median over
``R`` rounds (default 15) of the best of three runs per round, in microseconds per task.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
import timeit
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy_pgtask import EnqueueRequest, _ids, _json_text
from sqlalchemy_pgtask.enqueue.plan import plan_many, validate_many

#: `EnqueueRequest`'s fields with the ``__init__`` dataclasses writes.
GeneratedInit: Any = dataclasses.make_dataclass(
    "GeneratedInit",
    [(f.name, f.type, dataclasses.field(default=f.default))
     for f in dataclasses.fields(EnqueueRequest)],
    frozen=True, kw_only=True,
)


def ids_by_constructor(count: int) -> list[uuid.UUID]:
    stamp = (time.time_ns() // 1_000_000 & ((1 << 48) - 1)) << 80 | 0x7 << 76 | 0b10 << 62
    randomness = os.urandom(16 * count)
    return [
        uuid.UUID(int=stamp | int.from_bytes(randomness[at : at + 16], "big") & _ids._RANDOM)
        for at in range(0, 16 * count, 16)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    n = args.batch
    payloads = [{"i": i} for i in range(n)]
    requests = [EnqueueRequest(name="noop", payload=p) for p in payloads]
    rows = validate_many(requests)
    standard = _json_text._STANDARD.encode
    steps: dict[str, Callable[[], object]] = {
        "requests: EnqueueRequest": lambda: [EnqueueRequest(name="noop", payload=p)
                                             for p in payloads],
        "requests: generated __init__": lambda: [GeneratedInit(name="noop", payload=p)
                                                 for p in payloads],
        "ids: new_ids": lambda: _ids.new_ids(n),
        "ids: UUID(int=)": lambda: ids_by_constructor(n),
        "JSON: _json_text.encode": lambda: [_json_text.encode(p) for p in payloads],
        "JSON: JSONEncoder.encode": lambda: [standard(p) for p in payloads],
        "validate_many": lambda: validate_many(requests),
        "plan_many": lambda: plan_many(rows),
    }
    figures: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            best = min(timeit.repeat(steps[name], number=5, repeat=3)) / 5
            figures[name].append(best / n * 1e6)
    print(f"per task, batch of {n}, median of {args.rounds} rounds (us):")
    for name in names:
        print(f"  {name:32s} {statistics.median(figures[name]):7.3f}")


if __name__ == "__main__":
    main()
