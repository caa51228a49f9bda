"""outcome: decides what a finished attempt writes, and the JSON it stores; pure, no I/O.

`decide` is the whole decision, from what the handler returned or raised and why (if at all)
the worker asked it to stop, to the write: complete, fail (with or without a retry delay),
release, or nothing (the lease is gone).

A handler's return value must fit the result column (JSON, at most 1 MiB, no NUL): anything
else is a terminal ``result_rejected`` failure, because retrying would produce the same value
forever. An exception becomes a structured error document that always fits the error column:
long messages and tracebacks are truncated (and say so), NUL characters and unpaired surrogates
are replaced, so writing a failure can never fail.
"""

from __future__ import annotations

import asyncio
import json
import random
import traceback
from dataclasses import dataclass
from typing import Any, Final, Literal

from sqlalchemy_pgtask._logging import escape_controls
from sqlalchemy_pgtask.control import Fail, LeaseLost, Retry, TaskCancelled
from sqlalchemy_pgtask.durable.context import StopReason
from sqlalchemy_pgtask.errors import (
    DuplicateStep,
    InvalidOptionError,
    PayloadError,
    ReplayMismatch,
)
from sqlalchemy_pgtask.retry import RetryPolicy
from sqlalchemy_pgtask.validation import (
    ERROR_MAX_BYTES,
    RESULT_MAX_BYTES,
    check_delay,
    dump_json,
)

__all__ = [
    "ErrorKind",
    "Outcome",
    "WriteKind",
    "decide",
    "error_document",
    "one_line",
    "result_document",
]

#: The ``type`` of a stored error document: what ended the attempt.
ErrorKind = Literal[
    "handler_error",  # the handler raised; retried by policy
    "fail",  # the handler raised Fail: no retry
    "non_retryable",  # the handler raised one of its definition's non_retryable types
    "retry",  # the handler raised Retry: retried after its delay (or the policy's)
    "result_rejected",  # the return value cannot be stored: no retry, it would repeat
    "cancelled",  # someone cancelled the task
    "timeout",  # the attempt ran past its time limit; retried by policy
    "lease_expired",  # the worker died or stalled; recovery took the task back
    "outcome_rejected",  # the database refused to record the outcome
    "replay_mismatch",  # a durable call differs from the one recorded: no retry, it would repeat
    "duplicate_step",  # a step key used twice in one run: no retry, it would repeat
]

#: The fenced statement an outcome is written with.
WriteKind = Literal["complete", "fail", "release"]

_MESSAGE_MAX_CHARS: Final = 16 * 1024
_TRACEBACK_MAX_CHARS: Final = 128 * 1024
_TRUNCATED: Final = "...(truncated)\n"


def _clean(text: str, limit: int) -> tuple[str, bool]:
    """Text PostgreSQL's jsonb accepts, at most ``limit`` characters; True if it was cut."""
    safe = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(safe) <= limit:
        return safe, False
    return safe[:limit], True


def _qualified_name(exc_type: type[BaseException]) -> str:
    module = exc_type.__module__
    name = exc_type.__qualname__
    return name if module == "builtins" else f"{module}.{name}"


def _describe(exc: BaseException) -> tuple[str, str]:
    """The message and traceback of ``exc``, even when its ``__str__`` itself raises."""
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__} object>"
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        tb = "".join(traceback.format_tb(exc.__traceback__)) + message
    return message, tb


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one printable line, for logs (never raises, never holds NUL or
    another control character: an error message must not drive the terminal that shows the
    log, nor forge a line)."""
    message, _ = _describe(exc)
    text, cut = _clean(" ".join(message.split()), limit)
    return escape_controls(f"{type(exc).__name__}: {text}{'...' if cut else ''}")


def _encoded_size(document: dict[str, Any]) -> int:
    return len(json.dumps(document, ensure_ascii=False).encode("utf-8"))


def error_document(kind: str, exc: BaseException | None = None, **fields: Any) -> str:
    """The JSON error stored on the task and its attempt; always within ``ERROR_MAX_BYTES``.

    ``kind`` says what happened (``handler_error``, ``fail``, ``result_rejected``,
    ``cancelled`` ...); with an exception the document also carries its type, message and
    traceback.
    """
    document: dict[str, Any] = {"type": kind, **fields}
    if exc is not None:
        raw_message, raw_tb = _describe(exc)
        message, cut = _clean(raw_message, _MESSAGE_MAX_CHARS)
        # A class's __module__ and __qualname__ are any str (NUL and lone surrogates included).
        document["exception"] = _clean(_qualified_name(type(exc)), 1024)[0]
        document["message"] = message
        if cut:
            document["message_truncated"] = True
        # Keep the end of a long traceback: the innermost frames say where it failed.
        tail, tb_cut = _clean(raw_tb[-_TRACEBACK_MAX_CHARS:], _TRACEBACK_MAX_CHARS)
        tb_cut = tb_cut or len(raw_tb) > _TRACEBACK_MAX_CHARS

        def set_traceback() -> None:
            document["traceback"] = _TRUNCATED + tail if tb_cut else tail
            if tb_cut:
                document["traceback_truncated"] = True

        set_traceback()
        # JSON escaping can multiply the size of odd text: halve what is longest until it fits.
        while _encoded_size(document) > ERROR_MAX_BYTES:
            if len(tail) > 256:
                tail, tb_cut = tail[-(len(tail) // 2):], True
                set_traceback()
            elif len(document["message"]) > 256:
                document["message"] = document["message"][: len(document["message"]) // 2]
                document["message_truncated"] = True
            else:
                break
    if _encoded_size(document) > ERROR_MAX_BYTES:  # pathological extra fields
        document = {"type": kind, "truncated": True}
    return json.dumps(document, ensure_ascii=False)


def result_document(value: object) -> tuple[str | None, str | None]:
    """``(result_json, None)`` for a storable return value, else ``(None, error_json)``."""
    try:
        return dump_json("result", value, RESULT_MAX_BYTES), None
    except PayloadError as exc:
        return None, error_document("result_rejected", reason=exc.reason)
    except Exception as exc:
        # Serialising runs the value's own code (a collection's __iter__ or items()), and
        # the NUL scan recurses where the C encoder did not: whatever it raises, the attempt
        # must still end with a written outcome, not leave its task running until the lease
        # expires.
        return None, error_document(
            "result_rejected", reason=f"could not be serialised: {one_line(exc)}"
        )


def _requested_delay(retry: Retry) -> float | None:
    """``retry``'s own delay, checked again: a subclass may skip `Retry.__init__` (no
    ``delay`` at all) or set its own (a timedelta, a negative number). An unusable one means
    the policy's delay, rather than an outcome that cannot be written."""
    delay = getattr(retry, "delay", None)
    if delay is None:
        return None
    try:
        return check_delay("delay", delay)
    except InvalidOptionError:
        return None


@dataclass(frozen=True)
class Outcome:
    """What to write for a finished attempt."""

    kind: WriteKind
    #: The result JSON for ``complete``, the error JSON for ``fail``, None for ``release``.
    document: str | None = None
    #: For ``fail``: seconds until the retry, or None for no retry. For ``release``: seconds
    #: until the task may run again (None: at once).
    delay: float | None = None
    #: For ``fail``: the error's kind (also the document's ``type``), for logs and metrics.
    error_kind: ErrorKind | None = None


def _replay_error(exc: BaseException | None) -> ErrorKind | None:
    """``replay_mismatch`` or ``duplicate_step`` if ``exc`` is such an error, or was raised
    from or while handling one (a handler's wrapper changes nothing: the next run of the same
    code would meet it again); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ReplayMismatch):
            return "replay_mismatch"
        if isinstance(exc, DuplicateStep):
            return "duplicate_step"
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _failure(
    kind: ErrorKind, exc: BaseException | None, delay: float | None = None, **fields: Any
) -> Outcome:
    return Outcome("fail", error_document(kind, exc, **fields), delay, kind)


def decide(
    *,
    returned: object = None,
    raised: BaseException | None = None,
    stop: StopReason | None = None,
    stopped_by_worker: bool = False,
    policy: RetryPolicy,
    failed_attempts: int,
    non_retryable: tuple[type[BaseException], ...] = (),
    rng: random.Random | None = None,
) -> Outcome | None:
    """The write for an attempt whose handler returned ``returned`` or raised ``raised``.

    ``stop`` is why the worker asked the handler to stop, if it did; ``stopped_by_worker``
    says the worker cancelled the handler's coroutine itself (so a `CancelledError` is the
    worker's doing, not the handler's). ``failed_attempts`` counts the attempts that failed
    before this one. None means write nothing: the lease is gone, and with it the right to
    write. It never raises: deciding runs the handler's own code (its exception's ``__str__``,
    a `Retry` subclass's ``delay``, a result's ``__iter__``), and whatever that raises, the
    attempt still ends with a written outcome instead of holding its task until the lease
    expires: a ``handler_error`` retried by policy.
    """
    try:
        return _decide(
            returned=returned, raised=raised, stop=stop, stopped_by_worker=stopped_by_worker,
            policy=policy, failed_attempts=failed_attempts, non_retryable=non_retryable,
            rng=rng,
        )
    except Exception:
        # Nothing of the failure itself goes into the document: reading it may raise again.
        return Outcome(
            "fail",
            error_document(
                "handler_error", reason="the handler's outcome could not be read (its "
                "exception or its return value raised while being described)",
            ),
            policy.delay(failed_attempts + 1, rng),
            "handler_error",
        )


def _decide(
    *,
    returned: object,
    raised: BaseException | None,
    stop: StopReason | None,
    stopped_by_worker: bool,
    policy: RetryPolicy,
    failed_attempts: int,
    non_retryable: tuple[type[BaseException], ...],
    rng: random.Random | None,
) -> Outcome | None:
    if stop == "lease_lost":
        return None
    if stop == "timeout" and not isinstance(raised, LeaseLost):
        # Whatever the handler did once its time was up does not count.
        return _failure("timeout", None, policy.delay(failed_attempts + 1, rng))
    stopping = isinstance(raised, (LeaseLost, TaskCancelled)) or (
        isinstance(raised, asyncio.CancelledError) and stopped_by_worker
    )
    if stop is not None and stopping:
        if stop == "cancelled":
            return _failure("cancelled", None)
        return Outcome("release")  # shutdown, or a lease about to expire: hand it back
    if raised is None:
        result, rejected = result_document(returned)
        if rejected is not None:
            return Outcome("fail", rejected, None, "result_rejected")
        # A success after a cancel request is recorded as cancelled by the statement itself.
        return Outcome("complete", result)
    if isinstance(raised, TaskCancelled):
        return _failure("cancelled", None)
    if isinstance(raised, LeaseLost):
        return None
    if isinstance(raised, Fail):
        return _failure("fail", raised)
    if isinstance(raised, Retry):
        delay = _requested_delay(raised)
        if delay is None:
            # An explicit Retry retries even under a "never" policy: at once.
            delay = policy.delay(failed_attempts + 1, rng) or 0.0
        return _failure("retry", raised, max(0.0, delay))
    replay = _replay_error(raised)
    if replay is not None:
        return _failure(replay, raised)
    if isinstance(raised, non_retryable):
        return _failure("non_retryable", raised)
    # Anything else, a CancelledError the handler raised itself and SystemExit included.
    return _failure("handler_error", raised, policy.delay(failed_attempts + 1, rng))
