"""The `/v1/responses` request (OpenAI's Responses API, text in and out) and its checks.

Every field OpenAI defines either has its effect here or is refused with a 400 naming it
(`unsupported_fields`): tandem serves text input and output through the chat path, with no
tools, reasoning, background runs, includes, conversations or prompt templates. Fields that
carry no behaviour (`user`, `safety_identifier`, `metadata`, `parallel_tool_calls`) are
accepted and echoed in the response as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from tandem.errors import InvalidRequest
from tandem.protocols.openai import MAX_INT32, show_value

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
TEXT_FORMATS = ("text", "json_object", "json_schema")
MAX_METADATA_KEYS = 16  # OpenAI: up to 16 pairs, keys <= 64 characters, values <= 512


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields with an effect; anything else OpenAI defines is checked from the raw body."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    cache_salt: str | None = None  # vLLM's: as chat's (protocols/openai.py)
    parallel_tool_calls: bool | None = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    truncation: str | None = None
    text: dict[str, Any] | None = None


def _null_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _text_format(value: Any) -> bool:
    """`text` with a format tandem serves (text, json_object, json_schema; the schema itself
    is checked where chat checks response_format) and no verbosity."""
    if value is None:
        return True
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        return False
    fmt = value.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    return (fmt is None or kind in TEXT_FORMATS) and value.get("verbosity") is None


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (structured outputs: the engine's grammar
    enforces it). Responses spells json_schema flat: {type, name, schema, strict}."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


# field -> (is this value one tandem honours, what is expected instead)
_FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_empty, "no tools (tool calling is served on /v1/chat/completions)"),
    "tool_choice": (_null_or("none", "auto"), '"auto" or "none" (no tools on /v1/responses)'),
    "reasoning": (_empty, "null (this model does not reason in a separate channel)"),
    "background": (_null_or(False), "false (background responses are not supported)"),
    "background_options": (_empty, "null (background responses are not supported)"),
    "include": (_empty, "null or [] (no extra output data is available)"),
    "conversation": (_empty, "null (conversations are not stored; use previous_response_id)"),
    "prompt": (_empty, "null (stored prompt templates are not supported)"),
    "context_management": (_empty, "null (context compaction is not supported)"),
    "max_tool_calls": (_empty, "null (no tools on /v1/responses)"),
    "top_logprobs": (_null_or(0), "null or 0 (logprobs are served on /v1/chat/completions)"),
    "truncation": (_null_or("disabled"), '"disabled" (an input too long is a 400)'),
    "text": (_text_format, "a format of type text, json_object or json_schema; no verbosity"),
    "service_tier": (_null_or("auto", "default"), '"auto" or "default" (one tier)'),
    "prompt_cache_key": (_empty, "null (prefix caching is automatic: identical prefixes hit)"),
    "prompt_cache_retention": (_empty, "null (the prefix cache keeps what its memory holds)"),
    "prompt_cache_options": (_empty, "null (the prefix cache has no per-request options)"),
    "stream_options": (
        lambda v: _empty(v) or v == {"include_obfuscation": False},
        'null or {"include_obfuscation": false} (events carry no obfuscation padding)',
    ),
    "moderation": (_empty, "null (no moderation is run)"),
    "image": (_empty, "null (image generation is not supported)"),
    "access_programs": (_empty, "null"),
}


def unsupported_fields(body: dict[str, Any]) -> None:
    """Raise InvalidRequest naming the first field OpenAI defines whose value tandem would
    not honour (a non-empty `tools`, a `reasoning` config, `background: true`, ...)."""
    for name, (honoured, expected) in _FIELD_RULES.items():
        if name in body and not honoured(body[name]):
            raise InvalidRequest(
                f"{name}={show_value(body[name])} is not supported on /v1/responses; "
                f"expected {expected}",
                param=name,
            )


def validate_responses(req: ResponsesRequest) -> None:
    def check(ok: bool, param: str, value: Any, expected: str) -> None:
        if not ok:
            raise InvalidRequest(
                f"{param}={show_value(value)} is invalid; expected {expected}", param=param
            )

    check(bool(req.model), "model", req.model, "a non-empty model name")
    if req.max_output_tokens is not None:
        ok = 1 <= req.max_output_tokens <= MAX_INT32
        check(ok, "max_output_tokens", req.max_output_tokens, f"an integer in [1, {MAX_INT32}]")
    if req.temperature is not None:
        check(0.0 <= req.temperature <= 2.0, "temperature", req.temperature, "a number in [0, 2]")
    if req.top_p is not None:
        check(0.0 < req.top_p <= 1.0, "top_p", req.top_p, "a number in (0, 1]")
    if req.metadata is not None:
        expected = f"at most {MAX_METADATA_KEYS} string pairs"
        check(len(req.metadata) <= MAX_METADATA_KEYS, "metadata", req.metadata, expected)
    if req.previous_response_id is not None:
        check(bool(req.previous_response_id), "previous_response_id", "", "a response id")


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages ({role, content: str}); developer → system.
    Raises InvalidRequest naming `input[i]` (or `input[i].content[j]`) for an item that is
    not a text message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequest("input is an empty list; expected at least one item", param="input")
    return [_message(item, f"input[{i}]") for i, item in enumerate(value)]


def _message(item: Any, param: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest(
            f"{param}={show_value(item)} is invalid; expected a message object", param=param
        )
    kind = item.get("type", "message")
    if kind != "message":
        raise InvalidRequest(
            f"{param} has type {show_value(kind)}; /v1/responses takes text messages only "
            "(type 'message' with role and content)",
            param=f"{param}.type",
        )
    role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise InvalidRequest(
            f"{param}.role={show_value(item.get('role'))} is invalid; expected one of: "
            f"{', '.join(ROLES)}",
            param=f"{param}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{param}.content={show_value(content)} is invalid; expected a string or a list of "
            "text parts",
            param=f"{param}.content",
        )
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}={show_value(part)} is not supported; expected a text part "
                f"({' or '.join(TEXT_PARTS)} with text); images and files are served on "
                "/v1/chat/completions",
                param=where,
            )
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}
