"""Tool fields and response_format resolved by the frontend: validation naming the field, the
Hermes prompt for templates without tools, the round trip of tool_calls and tool results,
and the grammar that forces a call (it accepts exactly the calls it should)."""

from __future__ import annotations

import json

import llguidance
import pytest

from tandem.errors import InvalidRequest
from tandem.frontend.pipeline.structured import response_format_output
from tandem.frontend.pipeline.tools import ToolPlan, plan_tools, render_messages
from tandem.tokens import grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def plan(tools=None, choice=None, parallel=None) -> ToolPlan | None:  # type: ignore[no-untyped-def]
    return plan_tools(tools, choice, parallel, None, None)


def _accepts(spec: str, text: str) -> bool:
    tok = llguidance.LLTokenizer(_byte_tokenizer())
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(spec))
    ok = m.consume_tokens(list(text.encode()))
    return bool(ok) and m.is_accepting()


def _byte_tokenizer() -> str:
    """A tokenizers-JSON byte-level vocabulary: token i is byte i (plus an EOS)."""
    from tandem.tokens.byte_level import BYTE_TO_CHAR

    vocab = {BYTE_TO_CHAR[b]: b for b in range(256)}
    return json.dumps(
        {
            "version": "1.0",
            "added_tokens": [{"id": 256, "content": "</s>", "special": True, "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": False},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": False},
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
        }
    )  # fmt: skip


def test_no_tools_and_none() -> None:
    assert plan() is None
    none = plan([WEATHER], "none")
    assert none is not None and none.tools == [] and none.structured is None
    with pytest.raises(InvalidRequest) as info:
        plan(None, "required")
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}], None,
         "tools[0].function.parameters"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}},
         "tool_choice.function.name"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([], None, "tools"),
    ],
)  # fmt: skip
def test_malformed_tool_fields_name_the_field(tools, choice, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest) as info:
        plan(tools, choice)
    assert info.value.param == param


def test_legacy_functions_are_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        plan_tools(None, None, None, [{"name": "f"}], None)
    assert info.value.param == "functions" and "tools" in info.value.message


def test_hermes_prompt_and_round_trip() -> None:
    p = plan([WEATHER, TIME])
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out, tools = render_messages(messages, p, template_takes_tools=False)
    assert tools is None  # in the prompt instead
    assert (
        out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    )
    assert "<tool_call>" in out[0]["content"]
    body = out[2]["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    passed, tools = render_messages(messages, p, template_takes_tools=True)
    assert tools is not None and [t["function"]["name"] for t in tools] == [
        "get_weather",
        "get_time",
    ]
    assert passed[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert passed[3]["role"] == "tool"


def test_tool_result_needs_a_known_call_id() -> None:
    with pytest.raises(InvalidRequest) as info:
        render_messages([{"role": "tool", "tool_call_id": "x", "content": "1"}], None,
                        template_takes_tools=False)  # fmt: skip
    assert info.value.param == "messages[0].tool_call_id"


def test_forced_grammar_accepts_only_valid_calls() -> None:
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert named is not None and named.structured is not None and named.max_calls == 1
    spec = named.structured.spec
    assert spec is not None
    good = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert _accepts(spec, good)
    assert not _accepts(spec, good.replace("get_weather", "get_time"))  # not the named one
    assert not _accepts(spec, good.replace('"city"', '"town"'))  # arguments off-schema
    assert not _accepts(spec, good + "\n" + good)  # parallel_tool_calls=false: one call
    required = plan([WEATHER, TIME], "required")
    assert required is not None and required.structured is not None
    spec = required.structured.spec
    assert spec is not None
    other = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _accepts(spec, good + "\n" + other)
    assert not _accepts(spec, "plain text")


def test_response_format() -> None:
    assert response_format_output(None) is None
    assert response_format_output({"type": "text"}) is None
    out = response_format_output({"type": "json_object"})
    assert out is not None and out.kind == "json"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = response_format_output(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    )
    assert out is not None and out.kind == "json_schema" and out.strict
    assert json.loads(out.spec or "") == schema
    grammar.validate(out)
    for value, param in [
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
         "response_format.json_schema.name"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format"),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequest) as info:
            response_format_output(value)
        assert info.value.param == param
