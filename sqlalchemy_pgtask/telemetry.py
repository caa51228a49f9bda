"""telemetry: OpenTelemetry trace context carried by tasks; optional, and never a failure.

With ``opentelemetry-api`` installed (the ``otel`` extra), one trace runs from the code that
enqueues a task to the attempts that run it:

* `enqueue` (and ``enqueue_many``, and ``ctx.spawn``) writes the current trace context into
  the task's headers (``traceparent``, ``tracestate``, through the globally configured
  propagator) when a span is current. Headers the caller set are never overwritten: if any
  of the propagator's keys is already there, the headers are left as they are.
* the worker runs each attempt in a span (kind ``CONSUMER``) whose parent is the context
  stored in the headers, with the task's id, name, version, queue, attempt number and
  outcome as attributes; a failed attempt records its exception and has status ``ERROR``.
* each ``ctx.step`` whose function runs is a child span of its attempt's span (a replayed
  step runs nothing, and has no span).

Without the package, `ENABLED` is False and every hook in the hot paths costs one attribute
check. The API alone records nothing, so until the process installs a tracer provider (an
SDK ``TracerProvider``; see ``docs/observability.md``) the worker makes no span either
(`recording`): its hooks then cost one more check per attempt and step.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol, TypeVar

from sqlalchemy_pgtask._version import __version__

try:
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised by the tests through the flag
    ENABLED = False
else:
    ENABLED = True

__all__ = [
    "ATTEMPT_SPAN",
    "ENABLED",
    "STEP_SPAN",
    "AttemptSpan",
    "Traced",
    "load_provider",
    "recording",
    "run_step",
    "start_attempt_span",
    "trace_carrier",
    "with_trace_context",
]

T = TypeVar("T")

#: Span names: the task or step name follows (both have few distinct values, as span names
#: should).
ATTEMPT_SPAN: Final = "pgtask.attempt"
STEP_SPAN: Final = "pgtask.step"

_TRACER_NAME: Final = "sqlalchemy_pgtask"


class Traced(Protocol):
    """What a span needs from a handler's context (every task context has it); telemetry
    sits below the contexts, which call it."""

    @property
    def task_id(self) -> uuid.UUID: ...
    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def queue(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def headers(self) -> dict[str, Any]: ...


_TRACER: Any = None


def _tracer() -> Any:
    # A proxy until the application sets its provider, so it can be taken early and kept.
    global _TRACER
    if _TRACER is None:
        _TRACER = _trace.get_tracer(_TRACER_NAME, __version__)
    return _TRACER


_UNKNOWN: Final = object()


def recording() -> bool:
    """Whether the application installed a tracer provider (an SDK): until it does, the worker
    makes no span at all, since the API's no-op spans would cost time and record nothing."""
    # The API's own getter looks up an environment variable on every call while no provider
    # is set (microseconds per attempt); the global it reads is checked directly instead.
    provider = getattr(_trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:  # an API version without it: the public way
        provider = _trace.get_tracer_provider()
    return provider is not None and not isinstance(
        provider, (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider)
    )


def load_provider() -> None:
    """Load the tracer provider ``OTEL_PYTHON_TRACER_PROVIDER`` names, if any (the API loads
    it on first use; `recording` alone would never use it)."""
    _trace.get_tracer_provider()


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not break the span
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}"[:1024]


def trace_carrier() -> dict[str, str] | None:
    """The current trace context as header entries, or None without OpenTelemetry or a
    current span (read once per batch by ``enqueue_many``)."""
    if not ENABLED or not _trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return carrier or None


def with_trace_context(
    headers: Mapping[str, Any] | None, carrier: Mapping[str, str] | None
) -> Mapping[str, Any] | None:
    """``headers`` plus ``carrier``, or ``headers`` itself: with no carrier, when the caller
    already set one of its keys (theirs wins, whole), or for anything that is not a mapping
    (for validation to report)."""
    if carrier is None or (headers is not None and not isinstance(headers, Mapping)):
        return headers
    if headers is None:
        return carrier
    if any(key in headers for key in carrier):
        return headers
    return {**headers, **carrier}


class AttemptSpan:
    """One attempt's span, current in the handler's context until `end`."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Any, token: object) -> None:
        self._span = span
        self._token = token

    def end(self, outcome: str, raised: BaseException | None, error: bool) -> None:
        """Close the span with its ``outcome``; ``error`` marks it failed (with ``raised``)."""
        span = self._span
        span.set_attribute("pgtask.outcome", outcome)
        if error:
            if raised is not None:
                span.record_exception(raised)
            description = outcome if raised is None else _describe(raised)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, description))
        span.end()
        _context.detach(self._token)  # type: ignore[arg-type]


def _remote_parent(headers: Mapping[str, Any]) -> Any:
    # Only text values can be trace context; anything else in the headers is the caller's.
    carrier = {key: value for key, value in headers.items() if isinstance(value, str)}
    return _propagate.extract(carrier)


def start_attempt_span(ctx: Traced) -> AttemptSpan:
    """Start the span of the attempt ``ctx`` describes and make it current.

    Its parent is the trace context in the task's headers (a new trace without one), never
    whatever happens to be current in the worker. Call `AttemptSpan.end` in the same
    asyncio task (it restores the context).
    """
    span = _tracer().start_span(
        f"{ATTEMPT_SPAN} {ctx.name}",
        context=_remote_parent(ctx.headers),
        kind=_trace.SpanKind.CONSUMER,
        attributes={
            "pgtask.task.id": str(ctx.task_id),
            "pgtask.task.name": ctx.name,
            "pgtask.task.version": ctx.version,
            "pgtask.queue": ctx.queue,
            "pgtask.attempt": ctx.attempt,
            "messaging.system": "pgtask",
            "messaging.destination.name": ctx.queue,
        },
    )
    return AttemptSpan(span, _context.attach(_trace.set_span_in_context(span)))


def _fail(span: Any, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(_trace.Status(_trace.StatusCode.ERROR, _describe(exc)))


async def _awaited(awaitable: Awaitable[T], span: Any) -> T:
    # The step's coroutine runs here, not where it was created: make its span current again.
    token = _context.attach(_trace.set_span_in_context(span))
    try:
        return await awaitable
    except BaseException as exc:
        _fail(span, exc)
        raise
    finally:
        _context.detach(token)
        span.end()


def run_step(
    ctx: Traced, name: str, occurrence: int, fn: Callable[[], Any], *, wait: bool
) -> Any:
    """Call a step's ``fn`` in a child span of the current (attempt) span; return its result.

    With ``wait`` (an ``async def`` handler's step) an awaitable result is returned wrapped,
    so that the span lasts until it is awaited; otherwise the span ends when ``fn`` returns.
    Without a tracer provider (`recording`), just calls ``fn``.
    """
    if not recording():
        return fn()
    span = _tracer().start_span(
        f"{STEP_SPAN} {name}",
        attributes={
            "pgtask.task.id": str(ctx.task_id),
            "pgtask.step.name": name,
            "pgtask.step.occurrence": occurrence,
        },
    )
    token = _context.attach(_trace.set_span_in_context(span))
    try:
        result = fn()
    except BaseException as exc:
        _fail(span, exc)
        span.end()
        raise
    finally:
        _context.detach(token)
    if wait and isinstance(result, Awaitable):
        return _awaited(result, span)
    span.end()
    return result
