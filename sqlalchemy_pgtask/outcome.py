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
        document["exception"] = _qualified_name(type(exc))
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
