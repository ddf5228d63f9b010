"""The tool prompt for templates that take no `tools`, in each tool-call format: the system
block shows that format's markup, and earlier calls written back in it parse with the same
format's parser to the same calls (a conversation round-trips)."""

from __future__ import annotations

import json

import pytest
from tests.support.model_outputs import TOOLS

from tandem.frontend.pipeline import tool_prompt
from tandem.frontend.pipeline.parsers.registry import make_tool_parser
from tandem.frontend.pipeline.tools import plan_tools, render_messages
from tandem.protocols.discovery import TOOL_CALL_PARSERS

CALLS = [
    {
        "name": "get_current_weather",
        "arguments": {"location": "Paris", "days": 3, "include_hourly": True, "fields": ["t"]},
    },
    {"name": "get_time", "arguments": {"timezone": None}},
]
MARKUP = {
    "hermes": "<tool_call>",
    "llama3_json": '"parameters"',
    "mistral": "[TOOL_CALLS]",
    "pythonic": "[<function name>(",
    "qwen3_coder": "<function=",
}


@pytest.mark.parametrize("fmt", TOOL_CALL_PARSERS)
def test_written_calls_parse_back_to_the_same_calls(fmt: str) -> None:
    text = tool_prompt.calls_text(CALLS, fmt)
    content, calls = make_tool_parser(fmt, tools=TOOLS).parse(text)
    assert content is None
    expected = (
        CALLS
        if fmt != "qwen3_coder"
        else [CALLS[0], {"name": "get_time", "arguments": {"timezone": "null"}}]
    )
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls] == expected


@pytest.mark.parametrize("fmt", TOOL_CALL_PARSERS)
def test_a_template_without_tools_gets_the_prompt_of_the_models_format(fmt: str) -> None:
    tools = [t.to_dict() for t in TOOLS]
    plan = plan_tools(tools, None, None, None, None)
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "a1B2c3D4e",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "12:00"},
    ]
    messages, offered = render_messages(history, plan, template_takes_tools=False, parser=fmt)
    assert offered is None and messages[0]["role"] == "system"
    assert MARKUP[fmt] in messages[0]["content"] and "get_current_weather" in messages[0]["content"]
    assert messages[2]["content"] == tool_prompt.calls_text(
        [{"name": "get_time", "arguments": {}}], fmt
    )
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    forced = plan_tools(tools, "required", None, None, None)
    messages, _ = render_messages(history, forced, template_takes_tools=False, parser=fmt)
    assert "<tool_call>" in messages[0]["content"]  # a forced call is written in Hermes markup
    assert forced is not None and forced.parser(fmt) == "hermes" and plan is not None
    assert plan.parser(fmt) == fmt
