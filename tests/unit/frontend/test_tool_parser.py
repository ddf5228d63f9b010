"""The Hermes tool-call parser: whole texts and streamed pieces, several calls, malformed
blocks (they stay content), parallel_tool_calls=false and markup split across chunks."""

from __future__ import annotations

import json
import random

import pytest

from tandem.frontend.pipeline.parsers.hermes import HermesToolParser, parse_call
from tandem.frontend.pipeline.parsers.registry import make_tool_parser

ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
TWO = ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def test_whole_text_one_call_no_content() -> None:
    content, calls = HermesToolParser().parse(ONE)
    assert content is None
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10


def test_whole_text_content_around_and_two_calls() -> None:
    content, calls = HermesToolParser().parse("Let me check.\n" + TWO + "\n")
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2


def test_parallel_false_keeps_the_first_call() -> None:
    _, calls = HermesToolParser(max_calls=1).parse(TWO)
    assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
        "plain answer with <tool_call in it",
    ],
)
def test_malformed_blocks_stay_content(text: str) -> None:
    content, calls = HermesToolParser().parse(text)
    assert calls == [] and content == text


def test_string_arguments_are_kept_when_they_are_json() -> None:
    call = parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert call is not None and json.loads(call.arguments) == {"a": 1}
    assert parse_call('{"name": "f", "arguments": "nope"}') is None


def stream(parser: HermesToolParser, text: str, seed: int) -> tuple[str, list[dict]]:
    rng = random.Random(seed)
    content, deltas, pos = "", [], 0
    while pos < len(text):
        n = rng.randint(1, 7)
        c, d = parser.feed(text[pos : pos + n])
        content, deltas, pos = content + c, deltas + d, pos + n
    c, d = parser.feed("", final=True)
    return content + c, deltas + d


def reassemble(deltas: list[dict]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in d:
            assert call["id"] is None and d["type"] == "function"
            call["id"], call["name"] = d["id"], d["function"]["name"]
            assert d["function"]["arguments"] == ""
        call["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(8))
def test_streamed_pieces_reassemble_to_the_whole_parse(seed: int) -> None:
    text = "Sure.\n" + TWO + "\n"
    content, deltas = stream(HermesToolParser(), text, seed)
    assert content == "Sure.\n"  # the markup never leaks, whatever the chunking
    calls = reassemble(deltas)
    _, whole = HermesToolParser().parse(text)
    assert [c["name"] for c in calls] == [c.name for c in whole]
    assert [json.loads(c["arguments"]) for c in calls] == [json.loads(c.arguments) for c in whole]
    assert sum(1 for d in deltas if d["index"] == 0 and "arguments" in d["function"]) >= 2


def test_streamed_arguments_arrive_before_the_block_closes() -> None:
    parser = HermesToolParser()
    _, deltas = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert deltas[0]["function"]["name"] == "f"
    assert deltas[1]["function"]["arguments"] == '{"city": "Par'


def test_streamed_malformed_block_and_plain_text_stay_content() -> None:
    text = "a < b and <tool_call>oops</tool_call> done"
    content, deltas = stream(HermesToolParser(), text, 1)
    assert deltas == []
    assert content == text


def test_registry_names_known_parsers() -> None:
    assert isinstance(make_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="expected one of: hermes"):
        make_tool_parser("mistral2")
