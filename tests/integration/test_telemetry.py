"""OpenTelemetry end to end: one trace from the enqueuing span to the attempt and its steps.

A real worker runs the tasks; the spans are read from the SDK's in-memory exporter. The
process-wide tracer provider can be set once, so this module installs an SDK provider (or
reuses one) and gives each test its own exporter, reading only the spans of its own trace.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    EnqueueRequest,
    Registry,
    RetryPolicy,
    SyncTaskContext,
    TaskContext,
    WorkerOptions,
    enqueue_async,
    enqueue_many_async,
    telemetry,
)
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import task_row, wait_for_state
from tests.support.waiting import PATIENCE

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
AGAIN = RetryPolicy.fixed(0.0, jitter=False)


@pytest.fixture(scope="module")
def memory() -> Iterator[InMemorySpanExporter]:
    """An SDK provider (installed once per process) exporting to memory during this module."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield exporter
    finally:
        exporter.shutdown()  # drops whatever later modules' workers export


@pytest.fixture
def exporter(memory: InMemorySpanExporter) -> InMemorySpanExporter:
    memory.clear()
    return memory


@pytest.fixture
def detach_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail the test if OpenTelemetry reports a context detached in the wrong place."""
    with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
        yield
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.context")]


def in_trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [
        s for s in exporter.get_finished_spans()
        if s.context is not None and s.context.trace_id == trace_id
    ]


async def spans_of(
    exporter: InMemorySpanExporter, trace_id: int, count: int
) -> Sequence[ReadableSpan]:
    """Wait until ``count`` spans of the trace have ended; return them."""
    await wait_until(
        lambda: len(in_trace(exporter, trace_id)) >= count, PATIENCE,
        message=f"{count} spans of the trace",
    )
    return in_trace(exporter, trace_id)


def named(spans: Sequence[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


async def enqueue_in_span(engine: AsyncEngine, name: str, **options: Any) -> tuple[uuid.UUID, Any]:
    """Enqueue inside a span of the test's own; return the task id and that span."""
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request") as span:
        async with engine.begin() as conn:
            task_id = (await enqueue_async(conn, name, **options)).id
    return task_id, span


async def test_one_trace_runs_from_the_enqueuing_span_to_the_attempt_to_its_step(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    exporter: InMemorySpanExporter, detach_errors: None,
) -> None:
    registry = Registry()

    @registry.task("charge", version=3, queue="billing")
    async def charge(ctx: TaskContext, payload: None) -> int:
        async def call_bank() -> int:
            return 42

        return await ctx.step("call-bank", call_bank)

    task_id, request = await enqueue_in_span(
        pgtask_async_engine, "charge", version=3, queue="billing"
    )
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        spans = await spans_of(exporter, request.get_span_context().trace_id, 3)
    assert row["state"] == "succeeded"

    [enqueuing] = named(spans, "request")
    [attempt] = named(spans, "pgtask.attempt")
    [step] = named(spans, "pgtask.step")
    assert attempt.name == "pgtask.attempt charge"
    assert attempt.kind == SpanKind.CONSUMER
    assert parent_id(attempt) == span_id(enqueuing)
    assert attempt.parent is not None
    assert attempt.parent.is_remote
    assert (step.name, parent_id(step)) == ("pgtask.step call-bank", span_id(attempt))
    assert dict(attempt.attributes or {}) == {
        "pgtask.task.id": str(task_id),
        "pgtask.task.name": "charge",
        "pgtask.task.version": 3,
        "pgtask.queue": "billing",
        "pgtask.attempt": 1,
        "pgtask.outcome": "succeeded",
        "messaging.system": "pgtask",
        "messaging.destination.name": "billing",
    }
    assert attempt.status.status_code == StatusCode.UNSET
    assert dict(step.attributes or {}) == {
        "pgtask.task.id": str(task_id),
        "pgtask.step.name": "call-bank",
        "pgtask.step.occurrence": 0,
    }
    # The step ran inside its attempt.
    times = (attempt.start_time, step.start_time, step.end_time, attempt.end_time)
    assert None not in times
    assert list(times) == sorted(times)  # type: ignore[type-var]


async def test_a_sync_handlers_steps_and_own_spans_are_children_of_its_attempt(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    exporter: InMemorySpanExporter, detach_errors: None,
) -> None:
    registry = Registry()

    @registry.task("report")
    def report(ctx: SyncTaskContext, payload: None) -> int:
        with trace.get_tracer("app").start_as_current_span("render"):
            pass
        return ctx.step("count", lambda: 7)

    task_id, request = await enqueue_in_span(pgtask_async_engine, "report")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        spans = await spans_of(exporter, request.get_span_context().trace_id, 4)
    [attempt] = named(spans, "pgtask.attempt")
    [step] = named(spans, "pgtask.step")
    [render] = named(spans, "render")
    assert parent_id(step) == parent_id(render) == span_id(attempt)


async def test_a_failed_attempt_records_its_exception_and_the_retry_is_another_attempt_span(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    exporter: InMemorySpanExporter, detach_errors: None,
) -> None:
    registry = Registry()

    @registry.task("flaky", retry=AGAIN, max_attempts=2)
    async def flaky(ctx: TaskContext, payload: None) -> None:
        async def explode() -> None:
            raise ValueError(f"attempt {ctx.attempt} went wrong")

        await ctx.step("explode", explode, occurrence=ctx.attempt)

    task_id, request = await enqueue_in_span(pgtask_async_engine, "flaky")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
        spans = await spans_of(exporter, request.get_span_context().trace_id, 5)
    assert row["state"] == "failed"
    attempts = sorted(named(spans, "pgtask.attempt"), key=lambda s: s.start_time or 0)
    assert [dict(s.attributes or {})["pgtask.attempt"] for s in attempts] == [1, 2]
    assert [dict(s.attributes or {})["pgtask.outcome"] for s in attempts] == [
        "retrying", "failed",
    ]
    [request_span] = named(spans, "request")
    for span in attempts:  # both continue the enqueuing trace
        assert parent_id(span) == span_id(request_span)
        assert span.status.status_code == StatusCode.ERROR
        assert "ValueError" in (span.status.description or "")
        [event] = [e for e in span.events if e.name == "exception"]
        assert dict(event.attributes or {})["exception.type"] == "ValueError"
    steps = named(spans, "pgtask.step")
    assert len(steps) == 2
    assert all(s.status.status_code == StatusCode.ERROR for s in steps)


async def test_enqueue_adds_the_trace_context_only_when_a_span_is_current(
    pgtask_async_engine: AsyncEngine, exporter: InMemorySpanExporter
) -> None:
    async with pgtask_async_engine.begin() as conn:
        untraced = (await enqueue_async(conn, "job", headers={"tenant": "a"})).id
    traced, span = await enqueue_in_span(pgtask_async_engine, "job", headers={"tenant": "b"})

    assert (await task_row(pgtask_async_engine, untraced))["headers"] == {"tenant": "a"}
    headers = (await task_row(pgtask_async_engine, traced))["headers"]
    context = span.get_span_context()
    assert headers == {
        "tenant": "b",
        "traceparent": (
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        ),
    }


async def test_enqueue_never_overwrites_trace_headers_the_caller_set(
    pgtask_async_engine: AsyncEngine, exporter: InMemorySpanExporter
) -> None:
    own = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request"):
        async with pgtask_async_engine.begin() as conn:
            [one, other] = await enqueue_many_async(
                conn,
                [EnqueueRequest(name="job", headers=own), EnqueueRequest(name="job", queue="b")],
            )
    assert (await task_row(pgtask_async_engine, one.id))["headers"] == own
    assert "traceparent" in (await task_row(pgtask_async_engine, other.id))["headers"]


async def test_without_opentelemetry_nothing_is_added_and_no_span_is_made(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "ENABLED", False)  # as if opentelemetry-api were missing
    registry = Registry()
    stepped: list[int] = []

    @registry.task("plain")
    async def plain(ctx: TaskContext, payload: None) -> int:
        def one() -> int:
            stepped.append(1)
            return 1

        return await ctx.step("one", one)

    task_id, _ = await enqueue_in_span(pgtask_async_engine, "plain", headers={"tenant": "c"})
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, task_id, timeout=PATIENCE)
    assert (row["state"], row["headers"], stepped) == ("succeeded", {"tenant": "c"}, [1])
    with trace.get_tracer("tests").start_as_current_span("disabled"):
        assert telemetry.trace_carrier() is None
    # Only the test's own spans: the worker made none.
    assert [s.name for s in exporter.get_finished_spans()] == ["request", "disabled"]


async def test_a_spawned_child_runs_in_a_span_of_its_parents_trace(
    pgtask_database_url: str, pgtask_async_engine: AsyncEngine,
    exporter: InMemorySpanExporter, detach_errors: None,
) -> None:
    registry = Registry()
    children: list[uuid.UUID] = []

    @registry.task("parent")
    async def parent(ctx: TaskContext, payload: None) -> None:
        children.append(await ctx.spawn("spawn-kid", "kid"))

    @registry.task("kid")
    async def kid(ctx: TaskContext, payload: None) -> None:
        return None

    _, request = await enqueue_in_span(pgtask_async_engine, "parent")
    async with running_worker(registry, pgtask_database_url, OPTIONS):
        await wait_until(lambda: bool(children), PATIENCE, message="the spawn")
        await wait_for_state(pgtask_async_engine, children[0], timeout=PATIENCE)
        spans = await spans_of(exporter, request.get_span_context().trace_id, 3)
    [parent_attempt] = named(spans, "pgtask.attempt parent")
    [kid_attempt] = named(spans, "pgtask.attempt kid")
    assert parent_id(kid_attempt) == span_id(parent_attempt)
