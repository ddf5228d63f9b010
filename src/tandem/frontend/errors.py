"""The one mapping from tandem's error tree to HTTP status + OpenAI error JSON (and, for the
Anthropic Messages routes, Anthropic's status and error JSON: `anthropic_error`).

Body: {"error": {"message", "type", "param", "code"}}. Overloaded (and subclasses) add a
Retry-After header. msgspec decode errors become 400s naming the field and the bad value;
a body that is not UTF-8 or nests too deeply to decode is a 400 too.
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
    RateLimited,
    ServingError,
    Unauthorized,
)
from tandem.protocols.openai import show_value

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
    code: str | None = getattr(exc, "code", None)  # set by a handler (previous_response_not_found)
    if isinstance(exc, ModelNotFound):
        code = "model_not_found"
    elif isinstance(exc, ContextLengthExceeded):
        code = "context_length_exceeded"
    elif isinstance(exc, Unauthorized):
        code = "invalid_api_key"
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
        extra = exc.headers if isinstance(exc, RateLimited) else []
        return [("retry-after", str(max(1, math.ceil(exc.retry_after_s)))), *extra]
    if isinstance(exc, Unauthorized):
        return [("www-authenticate", 'Bearer realm="tandem"')]
    return []


# Anthropic's error `type` per HTTP status (its API reference, "Errors"); another 4xx is
# invalid_request_error, another 5xx api_error
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "temporarily overloaded" (tandem's 503 Overloaded)


def anthropic_status(exc: ServingError) -> int:
    """The Messages API's status: tandem's 503 Overloaded (queues full, no worker free) is
    Anthropic's 529; every other status is kept (a lost worker stays 503)."""
    status = error_status(exc)
    return OVERLOADED if isinstance(exc, Overloaded) and status == 503 else status


def anthropic_error(exc: ServingError, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}, "request_id"}."""
    status = anthropic_status(exc)
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": exc.message},
        "request_id": request_id,
    }


def internal_error(exc: BaseException) -> ServingError:
    return ServingError(f"internal error: {type(exc).__name__}: {exc}")


# what decoding a request body raises besides msgspec's own errors
BODY_ERRORS = (msgspec.MsgspecError, UnicodeDecodeError, RecursionError)


def decode_error(exc: Exception, body: bytes) -> InvalidRequest:
    """A 400 for a body that is not JSON or does not fit the request model (`exc` is one
    of BODY_ERRORS)."""
    if isinstance(exc, UnicodeDecodeError):  # msgspec < 0.23 on bad UTF-8 in a string
        bad = _utf8_error(body, exc.reason)
        return bad or InvalidRequest(f"request body is not valid UTF-8: {exc.reason}")
    if isinstance(exc, RecursionError):
        return InvalidRequest(
            "request body nests JSON arrays/objects too deeply to decode; "
            "no request field takes more than a few levels"
        )
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        # msgspec >= 0.23 reports bad UTF-8 in a string as "Invalid UTF-8 encoded string"
        # with no offset: say where it is, as for the UnicodeDecodeError of older versions
        bad = _utf8_error(body)
        return bad or InvalidRequest(f"request body is not valid JSON: {text}", param=None)
    if (m := _MISSING.search(text)) is not None:
        field = m.group("field")
        return InvalidRequest(f"missing required field '{field}'", param=field)
    m = _PATH.search(text)
    if m is None:
        return InvalidRequest(f"invalid request body: {text}")
    path = m.group("path")
    param = path.lstrip(".")
    value = _value_at(body, path)
    shown = "" if value is _UNKNOWN else f"={show_value(value)}"
    return InvalidRequest(f"{param}{shown} is invalid: {text[: m.start()]}", param=param)


def _utf8_error(body: bytes, reason: str | None = None) -> InvalidRequest | None:
    """The 400 naming where in the body the first bad UTF-8 byte is (msgspec's own offset,
    where it gives one, is within one string), with `reason` or the decoder's; None when the
    whole body decodes."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as whole:
        before = body[max(0, whole.start - 24) : whole.start].decode("utf-8", "replace")
        return InvalidRequest(
            f"request body is not valid UTF-8 at byte {whole.start} (after {before!r}): "
            f"{reason or whole.reason}"
        )
    return None


_UNKNOWN = object()


def _value_at(body: bytes, path: str) -> Any:
    """The JSON value at a msgspec error path like `.messages[0].role` (error path only);
    _UNKNOWN when it cannot be found (e.g. the body nests too deeply to decode untyped)."""
    try:
        node: Any = msgspec.json.decode(body)
        for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
            node = node[key] if key else node[int(index)]
        return node
    except Exception:
        return _UNKNOWN
