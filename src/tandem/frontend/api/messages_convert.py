"""An Anthropic Messages request as the equivalent chat request, so it runs the chat path's
template, tokenization, tools, images and routing unchanged: the same conversation through
`/v1/messages` and `/v1/chat/completions` becomes the same token ids (the same KV blocks).

- `system` (a string or text blocks) → the first system message; a `role: "system"` message
  → a system message in place.
- user content blocks: `text` → text parts, `image` (base64 or url source) → an `image_url`
  part (the multimodal path's limits and errors), `tool_result` → a `role: "tool"` message
  (before the turn's other blocks), its text content prefixed "Error: " when `is_error`.
- assistant content blocks: `text` → content, `tool_use` → `tool_calls` (input as JSON text);
  `thinking` / `redacted_thinking` of earlier turns are left out of the prompt, as Anthropic
  does. A final assistant message (prefill) is a 400: its continuation is not offered.
- `thinking` enabled / adaptive: the model's reasoning parser splits its thinking out (a 400
  naming `thinking` for a model without one); unset / disabled: the template is told not to
  think (`enable_thinking: false`).
- `tools` (client tools: name, description, input_schema, strict) → function tools;
  `tool_choice` auto / any / tool / none → "auto" / "required" / a named function / "none",
  `disable_parallel_tool_use` → `parallel_tool_calls: false`.
- `stop_sequences` → stop, `metadata.user_id` → user (logged), `output_config.format`
  json_schema → a json_schema response_format (the grammar engine enforces it).

Errors the chat path raises name chat's fields; `rename` turns them back into the Messages
request's (`messages[k]` → the block it came from, `tools[i].function.parameters` →
`tools[i].input_schema`, ...).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from tandem.errors import InvalidRequest
from tandem.protocols.anthropic import CountTokensRequest, MessagesRequest, check_messages_request
from tandem.protocols.openai import ChatCompletionRequest, show_value

IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
TOOL_FIELDS = {
    "name",
    "description",
    "input_schema",
    "type",
    "cache_control",
    "strict",
    "eager_input_streaming",
}
TEXT_FIELDS = {"type", "text", "cache_control", "citations"}


@dataclass(frozen=True, slots=True)
class ChatEquivalent:
    """The chat request of a Messages request, and where each chat message came from (the
    Messages parameter an error about `messages[k]` is about)."""

    chat: ChatCompletionRequest
    origins: list[str]
    thinking: bool  # `thinking` asked for (the model then needs a reasoning parser)

    def rename(self, exc: InvalidRequest) -> InvalidRequest:
        """`exc` (raised by the chat path) with the Messages request's field names."""

        def names(text: str) -> str:
            text = re.sub(r"messages\[(\d+)\]", lambda m: self._origin(int(m.group(1))), text)
            for chat, messages in _CHAT_NAMES:
                text = re.sub(chat, messages, text)
            return text

        exc.param = names(exc.param) if exc.param else exc.param
        exc.message = names(exc.message)
        exc.args = (exc.message,)
        return exc

    def _origin(self, k: int) -> str:
        return self.origins[k] if 0 <= k < len(self.origins) else f"messages[{k}]"


_CHAT_NAMES = (
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format", "output_config.format"),
    (r"\bstop\b", "stop_sequences"),
    (r"\.tool_call_id\b", ".tool_use_id"),
)


def chat_equivalent(
    req: CountTokensRequest, *, stream: bool = False, version: str | None = None
) -> ChatEquivalent:
    """Check `req` (sent with `anthropic-version` `version`) and translate it; raises
    InvalidRequest naming the Messages field."""
    check_messages_request(req, version)
    thinking = _thinking(req)
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _system_text(req.system, "system")})
        origins.append("system")
    for i, message in enumerate(req.messages):
        for chat_message, origin in _turn(i, message, last=i == len(req.messages) - 1):
            messages.append(chat_message)
            origins.append(origin)
    tools = [_tool(i, t) for i, t in enumerate(req.tools)] if req.tools is not None else None
    tool_choice, parallel = _tool_choice(req.tool_choice)
    if thinking and tool_choice not in (None, "auto", "none"):
        raise InvalidRequest(
            "tool_choice forces a tool call, which thinking cannot precede (as Anthropic "
            "answers); with thinking use tool_choice 'auto' or 'none'",
            param="tool_choice",
        )
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = {
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stop": req.stop_sequences,
            "user": (req.metadata or {}).get("user_id"),
        }
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(req.output_config),
        # without `thinking` a template that can think is told not to (Qwen3's flag; the
        # pipeline then parses no reasoning)
        chat_template_kwargs=None if thinking else {"enable_thinking": False},
        stream=stream,
        **fields,
    )
    return ChatEquivalent(chat, origins, thinking)


def _thinking(req: CountTokensRequest) -> bool:
    """Whether `thinking` asks for thinking; checks its fields. budget_tokens (>= 1024, below
    max_tokens, as Anthropic requires) is not a separate limit here: thinking and answer
    share max_tokens."""
    thinking = req.thinking
    if thinking is None:
        return False
    kind = thinking.get("type")
    allowed = {"enabled": {"type", "budget_tokens"}, "adaptive": {"type"}, "disabled": {"type"}}
    if not isinstance(kind, str) or kind not in allowed:
        _bad("thinking.type", kind, "'enabled', 'adaptive' or 'disabled'")
    if extra := set(thinking) - allowed[kind]:
        field = sorted(extra)[0]
        _bad(
            f"thinking.{field}",
            thinking[field],
            "unset (summarized or omitted display is not offered)",
        )
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        limit = req.max_tokens if isinstance(req, MessagesRequest) else None
        if not isinstance(budget, int) or budget < 1024 or (limit is not None and budget >= limit):
            below = f" below max_tokens={limit}" if limit is not None else ""
            _bad("thinking.budget_tokens", budget, f"an integer >= 1024{below}")
    return bool(kind != "disabled")


def no_reasoning_parser(thinking: dict[str, Any] | None, model: str) -> InvalidRequest:
    """The 400 for `thinking` asked of a model without a reasoning parser."""
    return InvalidRequest(
        f"thinking={show_value(thinking)} is not supported by model '{model}': it has no "
        "reasoning parser (--reasoning-parser), so its thinking cannot be told from its "
        "answer; accepted: unset or {'type': 'disabled'}",
        param="thinking",
    )


def _system_text(system: Any, param: str) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        _bad(param, system, "a string or a list of text blocks")
    return "".join(_text_block(f"{param}[{j}]", block) for j, block in enumerate(system))


def _text_block(param: str, block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        _bad(f"{param}.type", block.get("type") if isinstance(block, dict) else block, "'text'")
    if extra := set(block) - TEXT_FIELDS:
        _bad(f"{param}.{sorted(extra)[0]}", block[sorted(extra)[0]], "no such field")
    if block.get("citations"):
        _bad(f"{param}.citations", block["citations"], "unset (citations are not offered)")
    _cache_control(f"{param}.cache_control", block.get("cache_control"))
    text = block.get("text")
    if not isinstance(text, str):
        _bad(f"{param}.text", text, "a string")
    return text


def _cache_control(param: str, value: Any) -> None:
    """A breakpoint asks for nothing the automatic prefix cache does not do."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        _bad(param, value, "{'type': 'ephemeral'} (with an optional ttl '5m' or '1h')")
    if value.get("ttl", "5m") not in ("5m", "1h") or set(value) - {"type", "ttl"}:
        _bad(param, value, "{'type': 'ephemeral'} (with an optional ttl '5m' or '1h')")


def _turn(i: int, message: Any, *, last: bool) -> list[tuple[dict[str, Any], str]]:
    """The chat messages of `messages[i]`, each with its origin."""
    param = f"messages[{i}]"
    if not isinstance(message, dict) or set(message) - {"role", "content"}:
        _bad(param, message, "an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role == "system":
        return [({"role": "system", "content": _system_text(content, f"{param}.content")}, param)]
    if role not in ("user", "assistant"):
        _bad(f"{param}.role", role, "'user', 'assistant' or 'system'")
    if role == "assistant" and last:
        raise InvalidRequest(
            f"{param} is an assistant message: prefill (continuing the final assistant "
            "message) is not supported; end the conversation with a user message",
            param=param,
        )
    if isinstance(content, str):
        return [({"role": role, "content": content}, param)]
    if not isinstance(content, list):
        _bad(f"{param}.content", content, "a string or a list of content blocks")
    if role == "assistant":
        return [(_assistant(param, content), param)]
    return _user(param, content)


def _user(param: str, blocks: list[Any]) -> list[tuple[dict[str, Any], str]]:
    results: list[tuple[dict[str, Any], str]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(where, block)})
        elif kind == "image":
            parts.append(_image(where, block))
        elif kind == "tool_result":
            results.append((_tool_result(where, block), where))
        else:
            _bad(f"{where}.type", kind, "'text', 'image' or 'tool_result' in a user message")
    if parts:
        results.append(({"role": "user", "content": parts}, param))
    return results


def _image(param: str, block: dict[str, Any]) -> dict[str, Any]:
    """An image block as the chat path's `image_url` part (a data: URL for base64)."""
    _cache_control(f"{param}.cache_control", block.get("cache_control"))
    if set(block) - {"type", "source", "cache_control"}:
        extra = sorted(set(block) - {"type", "source", "cache_control"})[0]
        _bad(f"{param}.{extra}", block[extra], "unset (image transformations are not offered)")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            _bad(f"{param}.source.media_type", media_type, f"one of {IMAGE_MEDIA_TYPES}")
        if not isinstance(data, str) or not data:
            _bad(f"{param}.source.data", data, "the image as a base64 string")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        assert isinstance(source, dict)
        given = source.get("url")
        if not isinstance(given, str) or not given:
            _bad(f"{param}.source.url", given, "the image's URL")
        url = given
    else:
        _bad(f"{param}.source.type", kind, "'base64' or 'url' (files are not offered)")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(param: str, block: dict[str, Any]) -> dict[str, Any]:
    _cache_control(f"{param}.cache_control", block.get("cache_control"))
    known = {"type", "tool_use_id", "content", "is_error", "cache_control"}
    if extra := set(block) - known:
        _bad(f"{param}.{sorted(extra)[0]}", block[sorted(extra)[0]], "no such field")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(f"{param}.content[{k}]", b) for k, b in enumerate(content))
    elif not isinstance(content, str):
        _bad(f"{param}.content", content, "a string or a list of text blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        _bad(f"{param}.is_error", is_error, "true or false")
    text = f"Error: {content}" if is_error else content
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def _assistant(param: str, blocks: list[Any]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(where, block))
        elif kind == "tool_use":
            assert isinstance(block, dict)
            calls.append(_tool_use(where, block))
        elif kind not in ("thinking", "redacted_thinking"):  # earlier turns' thinking: dropped
            _bad(f"{where}.type", kind, "'text', 'tool_use' or 'thinking' in an assistant turn")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(param: str, block: dict[str, Any]) -> dict[str, Any]:
    _cache_control(f"{param}.cache_control", block.get("cache_control"))
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        _bad(f"{param}.id", call_id, "the call's id (a non-empty string)")
    if not isinstance(name, str) or not name:
        _bad(f"{param}.name", name, "the tool's name")
    if not isinstance(args, dict):
        _bad(f"{param}.input", args, "an object")
    arguments = json.dumps(args, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict):
        _bad(param, tool, "a tool object with 'name' and 'input_schema'")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        _bad(f"{param}.type", kind, "'custom' or unset (server tools are not offered)")
    if extra := set(tool) - TOOL_FIELDS:
        field = sorted(extra)[0]
        _bad(f"{param}.{field}", tool[field], "unset (not offered for tools here)")
    _cache_control(f"{param}.cache_control", tool.get("cache_control"))
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        _bad(f"{param}.input_schema", schema, "a JSON schema of type 'object'")
    fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
    if "description" in tool:
        fn["description"] = tool["description"]
    if "strict" in tool:
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(tool_choice, parallel_tool_calls) of chat."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind == "none":
        allowed = {"type"}
    if extra := set(choice) - allowed:
        _bad(f"tool_choice.{sorted(extra)[0]}", choice, f"only {sorted(allowed)}")
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        _bad("tool_choice.disable_parallel_tool_use", disable, "true or false")
    parallel = False if disable else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    _bad("tool_choice.type", kind, "'auto', 'any', 'tool' or 'none'")


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    spec = {"name": "output", "schema": fmt.get("schema"), "strict": True}
    return {"type": "json_schema", "json_schema": spec}


def _bad(param: str, value: Any, expected: str) -> NoReturn:
    raise InvalidRequest(
        f"{param}={show_value(value)} is invalid; expected {expected}", param=param
    )
