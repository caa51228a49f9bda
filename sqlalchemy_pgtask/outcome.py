"""outcome: turns what a handler did into the JSON the database stores; pure, no I/O.

A handler's return value must fit the result column (JSON, at most 1 MiB, no NUL): anything
else is a terminal ``result_rejected`` failure, because retrying would produce the same value
forever. An exception becomes a structured error document that always fits the error column:
long messages and tracebacks are truncated (and say so), NUL characters and unpaired surrogates
are replaced, so writing a failure can never fail.
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Final

from sqlalchemy_pgtask.errors import PayloadError
from sqlalchemy_pgtask.validation import ERROR_MAX_BYTES, RESULT_MAX_BYTES, dump_json

__all__ = ["error_document", "result_document"]

_MESSAGE_MAX_CHARS: Final = 16 * 1024
#: Room left for the other fields when the traceback is cut to fit ``ERROR_MAX_BYTES``.
_ENVELOPE_BYTES: Final = 2 * 1024


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


def error_document(kind: str, exc: BaseException | None = None, **fields: Any) -> str:
    """The JSON error stored on the task and its attempt.

    ``kind`` says what happened (``handler_error``, ``fail``, ``result_rejected``,
    ``cancelled`` ...); with an exception the document also carries its type, message and
    traceback.
    """
    document: dict[str, Any] = {"type": kind, **fields}
    if exc is not None:
        message, cut = _clean(str(exc), _MESSAGE_MAX_CHARS)
        document["exception"] = _qualified_name(type(exc))
        document["message"] = message
        if cut:
            document["message_truncated"] = True
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        budget = ERROR_MAX_BYTES - _ENVELOPE_BYTES - len(message.encode("utf-8"))
        tb_clean, _ = _clean(tb, len(tb))
        encoded = tb_clean.encode("utf-8")
        if len(encoded) > budget // 2:
            # Keep the end: the innermost frames say where it failed. JSON escaping can double
            # the size of a traceback, hence the halved budget.
            tail = encoded[-(budget // 2):].decode("utf-8", "ignore")
            document["traceback"] = "...(truncated)\n" + tail
            document["traceback_truncated"] = True
        else:
            document["traceback"] = tb_clean
    text = json.dumps(document, ensure_ascii=False)
    if len(text.encode("utf-8")) > ERROR_MAX_BYTES:  # pathological fields; keep the essentials
        text = json.dumps({"type": kind, "truncated": True}, ensure_ascii=False)
    return text


def result_document(value: object) -> tuple[str | None, str | None]:
    """``(result_json, None)`` for a storable return value, else ``(None, error_json)``."""
    try:
        return dump_json("result", value, RESULT_MAX_BYTES), None
    except PayloadError as exc:
        return None, error_document("result_rejected", reason=exc.reason)
