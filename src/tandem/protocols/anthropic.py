"""The Anthropic Messages API requests (`POST /v1/messages`, `/v1/messages/count_tokens`) and
their top-level checks.

Every field of the current Messages request has its effect or is a 400 naming it: a field
Anthropic does not define is refused while decoding (`forbid_unknown_fields`, as Anthropic
answers "Extra inputs are not permitted"); one it defines with a value tandem does not honour
is refused by `check_messages_request` (`FIELD_RULES`). Content blocks, tools and tool_choice
stay dicts: `frontend/api/messages_convert.py` checks them while it translates them into the
equivalent chat request.
"""

from __future__ import annotations

from typing import Any, NoReturn

import msgspec

from tandem.errors import InvalidRequest
from tandem.protocols.openai import MAX_INT32, MAX_STOP_STRINGS, show_value

# the `anthropic-version` header values tandem speaks; 2026-10-21 (the 2.x SDK's) removed
# temperature, top_p and top_k: sent with it they are a 400, as Anthropic answers
API_VERSIONS = ("2023-06-01", "2026-10-21")
SAMPLING_REMOVED_IN = "2026-10-21"
MAX_USER_ID_CHARS = 256  # metadata.user_id (Anthropic: an opaque id, no PII)


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/messages/count_tokens`: the prompt fields of a Messages request."""

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    speed: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/messages`. temperature / top_p / top_k: older clients send them (the 2.x SDK
    passes them through `extra_body`)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    context_management: Any = None
    mcp_servers: Any = None


def _cache_control(value: Any) -> bool:
    """Prefix caching is automatic and keeps blocks until evicted: an ephemeral breakpoint
    (5m or 1h) asks for nothing more."""
    return value is None or (
        isinstance(value, dict)
        and value.get("type") == "ephemeral"
        and set(value) <= {"type", "ttl"}
        and value.get("ttl", "5m") in ("5m", "1h")
    )


def _output_config(value: Any) -> bool:
    """`format` json_schema is a structured output (the grammar engine enforces it); `effort`
    needs a reasoning model."""
    if value is None:
        return True
    if not isinstance(value, dict) or set(value) - {"format", "effort"}:
        return False
    fmt = value.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        return False
    return value.get("effort") is None


# field -> (is this value honoured, what is accepted and why the rest is not)
FIELD_RULES: dict[str, tuple[Any, str]] = {
    "cache_control": (
        _cache_control,
        "unset or {'type': 'ephemeral', 'ttl': '5m'|'1h'}: prefix caching is automatic",
    ),
    "output_config": (
        _output_config,
        "unset or {'format': {'type': 'json_schema', 'schema': {...}}}; effort needs a "
        "reasoning model",
    ),
    "speed": (
        lambda v: v in (None, "standard"),
        "unset or 'standard' (there is no fast mode)",
    ),
    "service_tier": (
        lambda v: v in (None, "auto", "standard_only"),
        "unset, 'auto' or 'standard_only' (tandem has one tier: standard)",
    ),
    "container": (lambda v: v is None, "unset (no code-execution containers)"),
    "diagnostics": (lambda v: v is None, "unset (no prompt-cache diagnostics)"),
    "inference_geo": (lambda v: v is None, "unset (inference runs where tandem runs)"),
    "context_management": (lambda v: v is None, "unset (no context editing)"),
    "mcp_servers": (lambda v: v is None, "unset (no MCP connector)"),
}


def check_messages_request(req: CountTokensRequest, version: str | None = None) -> None:
    """Raise InvalidRequest naming the first top-level field whose value tandem does not
    honour or whose value is out of range (`version`: the request's `anthropic-version`)."""
    for name, (honoured, accepted) in FIELD_RULES.items():
        value = getattr(req, name, None)
        if not honoured(value):
            raise InvalidRequest(
                f"{name}={show_value(value)} is not supported by this server; accepted: {accepted}",
                param=name,
            )
    if not req.messages:
        _bad("messages", req.messages, "at least one message")
    if not isinstance(req, MessagesRequest):
        return
    if version == SAMPLING_REMOVED_IN:
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                raise InvalidRequest(
                    f"{name}: anthropic-version {version} removed it; leave it unset, or send "
                    f"anthropic-version {API_VERSIONS[0]} to use it",
                    param=name,
                )
    if not 1 <= req.max_tokens <= MAX_INT32:
        hint = " (max_tokens=0, cache pre-warming, is not offered)" if req.max_tokens == 0 else ""
        _bad("max_tokens", req.max_tokens, f"an integer in [1, {MAX_INT32}]{hint}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        _bad("temperature", req.temperature, "a number in [0, 1]")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        _bad("top_p", req.top_p, "a number in (0, 1]")
    if req.top_k is not None and not 0 <= req.top_k <= MAX_INT32:
        _bad("top_k", req.top_k, f"an integer in [0, {MAX_INT32}] (0: off)")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        _bad("stop_sequences", stops, f"at most {MAX_STOP_STRINGS} non-empty strings")
    metadata = req.metadata or {}
    if set(metadata) - {"user_id"}:
        _bad("metadata", metadata, "an object with at most 'user_id'")
    user_id = metadata.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > MAX_USER_ID_CHARS):
        _bad("metadata.user_id", user_id, f"a string of at most {MAX_USER_ID_CHARS} characters")


def _bad(param: str, value: Any, expected: str) -> NoReturn:
    raise InvalidRequest(
        f"{param}={show_value(value)} is invalid; expected {expected}", param=param
    )
