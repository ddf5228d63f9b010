"""Reasoning parsers (`<think>...</think>` → reasoning_content): DeepSeek-R1 and Qwen3 styles
on whole texts and streamed at every split point, tags never in either part, and a tool call
written while thinking never parsed as a call."""

from __future__ import annotations

import json

import pytest
from tests.support.model_outputs import REASONING, TOOLS

from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.parsers.reasoning import (
    prompt_opens_think,
    thinking_disabled,
)
from tandem.frontend.pipeline.parsers.registry import make_reasoning_parser


@pytest.mark.parametrize(("style", "opened", "text", "reasoning", "content"), REASONING)
def test_reasoning_is_split_from_the_content_at_every_split_point(
    style: str, opened: bool, text: str, reasoning: str | None, content: str
) -> None:
    parser = make_reasoning_parser(style, prompt_opens_think=opened)
    assert parser.parse(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        parser = make_reasoning_parser(style, prompt_opens_think=opened)
        r1, c1 = parser.feed(text[:cut])
        r2, c2 = parser.feed(text[cut:], final=True)
        assert (r1 + r2, c1 + c2) == (reasoning or "", content), cut
        assert "think>" not in c1 + c2


def test_a_call_inside_reasoning_is_not_a_call() -> None:
    *_, text, reasoning, _ = REASONING[-1]
    parsed = OutputParser.make("hermes", "qwen3", tools=TOOLS).parse(text)
    assert parsed.reasoning == reasoning and parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_current_weather", {"location": "Paris"})
    ]
    for cut in range(len(text) + 1):
        parser = OutputParser.make("hermes", "qwen3", tools=TOOLS)
        a, b = parser.feed(text[:cut]), parser.feed(text[cut:], final=True)
        assert a.reasoning + b.reasoning == reasoning
        assert a.content + b.content == ""
        assert [c.name for c in parser.calls] == ["get_current_weather"]


def test_the_request_and_the_prompt_decide_where_reasoning_starts() -> None:
    assert thinking_disabled({"enable_thinking": False})
    assert thinking_disabled({"thinking": False})
    assert not thinking_disabled({"enable_thinking": True}) and not thinking_disabled(None)
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="expected one of: deepseek_r1, qwen3"):
        make_reasoning_parser("r1", prompt_opens_think=False)
