"""The one mapping from tandem's error tree to HTTP status + OpenAI error JSON.

Body: {"error": {"message", "type", "param", "code"}}. Overloaded (and subclasses) add a
Retry-After header. msgspec decode errors become 400s naming the field and the bad value.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from tandem.errors import (
    ContextLengthExceeded,
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PeerGone,
    ServingError,
)

_json = msgspec.json.Encoder()
_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def error_status(exc: ServingError) -> int:
    if isinstance(exc, PeerGone):
        return 503
    if isinstance(exc, DeadlineExceeded):
        return 504
    return int(exc.status_code)


def error_body(exc: ServingError) -> bytes:
    code: str | None = None
    if isinstance(exc, ModelNotFound):
        code = "model_not_found"
    elif isinstance(exc, ContextLengthExceeded):
        code = "context_length_exceeded"
    return _json.encode(
        {
            "error": {
                "message": exc.message,
                "type": exc.error_type,
                "param": exc.param,
                "code": code,
            }
        }
    )


def error_headers(exc: ServingError) -> list[tuple[str, str]]:
    if isinstance(exc, Overloaded):
        return [("retry-after", str(max(1, math.ceil(exc.retry_after_s))))]
    return []


def internal_error(exc: BaseException) -> ServingError:
    return ServingError(f"internal error: {type(exc).__name__}: {exc}")


def decode_error(exc: msgspec.MsgspecError, body: bytes) -> InvalidRequest:
    """A 400 for a body that is not JSON or does not fit the request model."""
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return InvalidRequest(f"request body is not valid JSON: {text}", param=None)
    if (m := _MISSING.search(text)) is not None:
        field = m.group("field")
        return InvalidRequest(f"missing required field '{field}'", param=field)
    m = _PATH.search(text)
    if m is None:
        return InvalidRequest(f"invalid request body: {text}")
    path = m.group("path")
    param = path.lstrip(".")
    value = _value_at(body, path)
    expected = text[: m.start()]
    return InvalidRequest(f"{param}={value!r} is invalid: {expected}", param=param)


def _value_at(body: bytes, path: str) -> Any:
    """The JSON value at a msgspec error path like `.messages[0].role` (error path only)."""
    try:
        node: Any = msgspec.json.decode(body)
        for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
            node = node[key] if key else node[int(index)]
        return node
    except Exception:
        return None
