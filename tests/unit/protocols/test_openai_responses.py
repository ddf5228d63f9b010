"""`/v1/responses` request checks: each field OpenAI defines that tandem does not honour is a
400 naming it, the honoured values pass, and input items become chat messages."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.errors import InvalidRequest
from tandem.protocols.openai_responses import input_messages, unsupported_fields


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "name": "f", "parameters": {}}]),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "name": "f"}),
        ("reasoning", {"effort": "low"}),
        ("background", True),
        ("include", ["message.output_text.logprobs"]),
        ("conversation", "conv_1"),
        ("prompt", {"id": "pmpt_1"}),
        ("max_tool_calls", 3),
        ("top_logprobs", 2),
        ("truncation", "auto"),
        ("text", {"format": {"type": "grammar", "grammar": "x"}}),
        ("text", {"verbosity": "low"}),
        ("service_tier", "flex"),
        ("prompt_cache_key", "k"),
        ("stream_options", {"include_obfuscation": True}),
        ("context_management", [{"type": "compaction"}]),
    ],
)
def test_an_unhonoured_value_is_a_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        unsupported_fields({"model": "m", "input": "x", field: value})
    assert err.value.param == field
    assert "not supported" in err.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", []),
        ("tool_choice", "auto"),
        ("tool_choice", "none"),
        ("reasoning", None),
        ("background", False),
        ("include", []),
        ("truncation", "disabled"),
        ("text", {"format": {"type": "text"}}),
        ("text", {"format": {"type": "json_object"}}),
        ("text", {"format": {"type": "json_schema", "name": "n", "schema": {}}}),
        ("service_tier", "auto"),
        ("top_logprobs", 0),
        ("stream_options", {"include_obfuscation": False}),
    ],
)
def test_values_with_their_documented_effect_pass(field: str, value: Any) -> None:
    unsupported_fields({"model": "m", "input": "x", field: value})


def test_input_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "b", "annotations": []}],
        },
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}],
        },
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "cd"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([], "input"),
        ([{"type": "function_call_output", "call_id": "c", "output": "x"}], "input[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        (["plain"], "input[0]"),
        ([{"role": "user", "content": 3}], "input[0].content"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}],
            "input[0].content[0]",
        ),
    ],
)
def test_other_input_items_are_400s_naming_where(items: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        input_messages(items)
    assert err.value.param == param


def test_every_field_the_sdk_sends_has_an_effect_or_a_rule() -> None:
    """Walks the official SDK's request types: a field OpenAI adds fails this test until it is
    honoured (a ResponsesRequest field) or refused (a rule)."""
    from openai.types import embedding_create_params
    from openai.types.responses import response_create_params

    from tandem.protocols.openai_embedding import EmbeddingRequest
    from tandem.protocols.openai_responses import _FIELD_RULES, ResponsesRequest

    sdk = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    handled = set(ResponsesRequest.__struct_fields__) | set(_FIELD_RULES)
    assert sdk - handled == set()
    embedding_sdk = set(embedding_create_params.EmbeddingCreateParams.__annotations__)
    assert embedding_sdk - set(EmbeddingRequest.__struct_fields__) == set()


def test_text_format_maps_to_chats_response_format() -> None:
    from tandem.protocols.openai_responses import response_format

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    assert response_format(text) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": schema, "strict": True},
    }
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert response_format({"format": {"type": "text"}}) is None
    assert response_format(None) is None
