"""A Messages request as its chat equivalent (`messages_convert`): system, turns, content
blocks, tools and tool_choice translated; what tandem does not honour refused naming the
Messages field; the chat path's errors renamed to the Messages fields."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.errors import InvalidRequest
from tandem.frontend.api.messages_convert import chat_equivalent
from tandem.protocols.anthropic import CountTokensRequest, MessagesRequest

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _req(**kw: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}
    return msgspec.json.decode(msgspec.json.encode(body), type=MessagesRequest)


def _refused(param: str, **kw: Any) -> str:
    with pytest.raises(InvalidRequest) as info:
        chat_equivalent(_req(**kw))
    assert info.value.param == param, info.value.message
    return info.value.message


def test_system_string_and_blocks_become_the_same_system_message() -> None:
    plain = chat_equivalent(_req(system="Be brief."))
    blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    split = chat_equivalent(_req(system=blocks))
    assert plain.chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert split.chat.messages == plain.chat.messages
    assert plain.origins == ["system", "messages[0]"]


def test_sampling_and_stop_fields_map_to_chat() -> None:
    chat = chat_equivalent(
        _req(
            temperature=0.5,
            top_p=0.9,
            top_k=5,
            stop_sequences=["END"],
            metadata={"user_id": "u-1"},
        ),
        stream=True,
    ).chat
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k) == (8, 0.5, 0.9, 5)
    assert chat.stop == ["END"] and chat.user == "u-1" and chat.stream


def test_a_tool_round_trip_becomes_tool_calls_and_a_tool_message() -> None:
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    eq = chat_equivalent(_req(messages=turns, tools=[WEATHER]))
    assistant, tool, user = eq.chat.messages[1:]
    assert assistant["content"] == "Let me look."  # the earlier turn's thinking is left out
    call = assistant["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert user == {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}
    assert eq.origins[2:] == ["messages[2].content[0]", "messages[2]"]
    assert eq.chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather in a city",
            },
        }
    ]


def test_an_error_tool_result_says_so() -> None:
    turns = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t",
                    "is_error": True,
                    "content": [{"type": "text", "text": "no such city"}],
                }
            ],
        },
    ]
    assert (
        chat_equivalent(_req(messages=turns)).chat.messages[2]["content"] == "Error: no such city"
    )


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            None,
        ),
        ({"type": "none"}, "none", None),
    ],
)
def test_tool_choice_maps_to_chats(choice: Any, chat_choice: Any, parallel: Any) -> None:
    chat = chat_equivalent(_req(tools=[WEATHER], tool_choice=choice)).chat
    assert chat.tool_choice == chat_choice and chat.parallel_tool_calls is parallel


def test_image_blocks_become_image_url_parts() -> None:
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
        {"type": "text", "text": "What is this?"},
    ]
    parts = chat_equivalent(_req(messages=[{"role": "user", "content": blocks}])).chat.messages[0]
    assert parts["content"][:2] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
    ]


def test_output_config_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat = chat_equivalent(
        _req(output_config={"format": {"type": "json_schema", "schema": schema}})
    ).chat
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


def test_what_tandem_does_not_honour_is_refused_by_name() -> None:
    _refused("thinking.budget_tokens", thinking={"type": "enabled", "budget_tokens": 512})
    _refused("thinking.budget_tokens", thinking={"type": "enabled", "budget_tokens": 2048})
    _refused("thinking.display", thinking={"type": "adaptive", "display": "omitted"})
    forced = {"tools": [WEATHER], "tool_choice": {"type": "any"}}
    _refused("tool_choice", thinking={"type": "adaptive"}, **forced)
    _refused("service_tier", service_tier="priority")
    _refused("speed", speed="fast")
    _refused("output_config", output_config={"effort": "high"})
    _refused("container", container="c-1")
    _refused("inference_geo", inference_geo="us")
    _refused("max_tokens", max_tokens=0)
    _refused("temperature", temperature=1.5)
    _refused("metadata", metadata={"project": "x"})
    _refused("tools[0].type", tools=[{"type": "web_search_20250305", "name": "web_search"}])
    _refused("tools[0].defer_loading", tools=[{**WEATHER, "defer_loading": True}])
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    _refused("messages[0].content[0].type", messages=[{"role": "user", "content": [doc]}])
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    assert "prefill" in _refused("messages[1]", messages=prefill)
    cite = {"type": "text", "text": "x", "citations": [{"type": "char_location"}]}
    _refused("system[0].citations", system=[cite])
    _refused("cache_control", cache_control={"type": "persistent"})
    chat_equivalent(_req(cache_control={"type": "ephemeral", "ttl": "1h"}))  # accepted


def test_thinking_asks_the_model_to_think_or_not() -> None:
    asked = chat_equivalent(
        _req(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048})
    )
    assert asked.thinking and asked.chat.chat_template_kwargs is None
    for off in ({"type": "disabled"}, None):
        quiet = chat_equivalent(_req(thinking=off))
        assert not quiet.thinking
        assert quiet.chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat_equivalent(_req(thinking={"type": "adaptive"})).thinking


def test_unknown_fields_are_refused_while_decoding() -> None:
    body = b'{"model": "m", "max_tokens": 8, "messages": [], "frequency_penalty": 1}'
    with pytest.raises(msgspec.ValidationError, match="frequency_penalty"):
        msgspec.json.decode(body, type=MessagesRequest)


def test_count_tokens_takes_the_prompt_fields_only() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s"}
    req = msgspec.json.decode(msgspec.json.encode(body), type=CountTokensRequest)
    assert chat_equivalent(req).chat.max_tokens is None
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        msgspec.json.decode(msgspec.json.encode({**body, "max_tokens": 4}), type=CountTokensRequest)


def test_chat_errors_are_renamed_to_the_messages_fields() -> None:
    turns = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}]},
    ]
    eq = chat_equivalent(_req(system="s", messages=turns))
    err = eq.rename(InvalidRequest("messages[2].content is bad", param="messages[2].content"))
    assert err.param == "messages[1].content" and err.message == "messages[1].content is bad"
    err = eq.rename(InvalidRequest("x", param="tools[0].function.parameters"))
    assert err.param == "tools[0].input_schema"
    assert (
        eq.rename(InvalidRequest("x", param="tool_choice.function.name")).param
        == "tool_choice.name"
    )
    assert eq.rename(InvalidRequest("x", param="stop")).param == "stop_sequences"
    assert eq.rename(InvalidRequest("x", param="messages[0]")).param == "system"


_KEYS = st.sampled_from(
    ["type", "text", "role", "content", "source", "id", "name", "input", "tool_use_id",
     "is_error", "cache_control", "media_type", "data", "url", "citations", "input_schema",
     "description", "strict", "budget_tokens", "disable_parallel_tool_use"]
)  # fmt: skip
_VALUES = st.sampled_from(
    ["text", "image", "tool_use", "tool_result", "thinking", "user", "assistant", "system",
     "base64", "url", "ephemeral", "object", "auto", "any", "tool", "none", "enabled", ""]
)  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 5000) | _VALUES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(st.dictionaries(_KEYS, _JSON, max_size=3), min_size=1, max_size=3),
    system=st.none() | _VALUES | st.lists(st.dictionaries(_KEYS, _JSON, max_size=3), max_size=2),
    tools=st.none() | st.lists(st.dictionaries(_KEYS, _JSON, max_size=4), max_size=2),
    tool_choice=st.none() | st.dictionaries(_KEYS, _JSON, max_size=3),
    thinking=st.none() | st.dictionaries(_KEYS, _JSON, max_size=2),
)
def test_any_body_is_translated_or_refused_by_name(**fields: Any) -> None:
    """Whatever a client sends in the blocks, the conversion answers a chat request or an
    InvalidRequest naming a field; nothing else escapes (a 500)."""
    body = {k: v for k, v in fields.items() if v is not None}
    try:
        req = _req(**body)
    except msgspec.ValidationError:
        return  # the decode's own 400
    try:
        chat_equivalent(req)
    except InvalidRequest as exc:
        assert exc.param, exc.message
