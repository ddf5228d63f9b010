"""The tool-call parsers on recorded-style outputs of Llama 3.x, Mistral, Qwen3-Coder and
pythonic models: whole texts, streamed at every split point (the deltas add up to what the
whole text parses to), malformed and cut outputs (their text comes back as content, nothing
raises), parallel_tool_calls=false, and the format a chat template makes certain."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tests.support.model_outputs import MALFORMED, TOOLS, WELL_FORMED

from tandem.frontend.pipeline.parsers.mistral import MistralToolParser
from tandem.frontend.pipeline.parsers.registry import (
    detect_reasoning_parser,
    detect_tool_parser,
    make_tool_parser,
)
from tandem.protocols.discovery import TOOL_CALL_PARSERS

CASES = [(fmt, *case) for fmt, cases in WELL_FORMED.items() for case in cases]
BAD = [(fmt, text) for fmt, texts in MALFORMED.items() for text in texts]


def _id(case: Any) -> str:
    return str(case)[:40] if isinstance(case, str) else str(case)


def stream(fmt: str, pieces: list[str]) -> tuple[str, dict[int, dict[str, Any]], Any]:
    """(content, calls by index: id, name, arguments) of `pieces` fed in order."""
    parser = make_tool_parser(fmt, tools=TOOLS)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        text, deltas = parser.feed(piece, final=i == len(pieces) - 1)
        content += text
        for d in deltas:
            if "id" in d:  # the head: id, type and name before any arguments
                assert d["index"] not in calls and d["type"] == "function"
                assert d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
            else:
                calls[d["index"]]["args"] += d["function"]["arguments"]
    return content, calls, parser


@pytest.mark.parametrize(("fmt", "text", "content", "expected"), CASES, ids=_id)
def test_a_whole_output_gives_its_content_and_calls(
    fmt: str, text: str, content: str | None, expected: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, calls = make_tool_parser(fmt, tools=TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("fmt", "text", "content", "expected"), CASES, ids=_id)
def test_streamed_at_every_split_point_it_adds_up_to_the_whole(
    fmt: str, text: str, content: str | None, expected: list[tuple[str, dict[str, Any]]]
) -> None:
    _, whole = make_tool_parser(fmt, tools=TOOLS).parse(text)
    splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    rng = random.Random(len(text))
    for _ in range(20):  # and in many small pieces, as tokens come
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    splits.append(list(text))
    for pieces in splits:
        got, calls, _ = stream(fmt, pieces)
        assert (got.strip() or None) == (content.strip() if content else None), pieces
        assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == expected, pieces
        assert all(c["args"].startswith("{") for c in calls.values()), pieces
        if fmt != "hermes":  # exactly the text parse gives (Hermes re-encodes a whole call)
            assert [c["args"] for c in calls.values()] == [c.arguments for c in whole]


@pytest.mark.parametrize(("fmt", "text"), BAD, ids=_id)
def test_a_malformed_or_cut_output_is_its_text(fmt: str, text: str) -> None:
    assert make_tool_parser(fmt, tools=TOOLS).parse(text) == (text, [])
    for cut in range(len(text) + 1):  # streamed: never raises; unannounced text flushes
        content, calls, _ = stream(fmt, [text[:cut], text[cut:]])
        if not calls:
            assert content == text


def test_text_before_a_call_streams_before_the_call_ends() -> None:
    parser = make_tool_parser("mistral")
    assert parser.feed("Let me check. [TOOL_") == ("Let me check. ", [])
    text, deltas = parser.feed('CALLS]get_time[ARGS]{"timezone": ')
    assert text == "" and deltas[0]["function"]["name"] == "get_time"
    assert deltas[1]["function"]["arguments"] == '{"timezone": '


def test_a_stream_cut_inside_a_call_keeps_the_announced_call() -> None:
    content, calls, _ = stream("llama3_json", ['{"name": "get_time", "parameters": {"tz"', ""])
    assert content == "" and calls[0]["name"] == "get_time"
    assert calls[0]["args"] == '{"tz"'


def test_parallel_tool_calls_false_keeps_the_first_call_in_every_format() -> None:
    for fmt, text, _, expected in CASES:
        if len(expected) > 1:
            _, calls = make_tool_parser(fmt, max_calls=1, tools=TOOLS).parse(text)
            assert [c.name for c in calls] == [expected[0][0]], fmt
            _, streamed, _ = stream(fmt, list(text))
            assert len(streamed) == len(expected)  # the stream without the limit
            parser = make_tool_parser(fmt, max_calls=1, tools=TOOLS)
            parser.feed(text, final=True)
            assert len(parser.calls) == 1


def test_mistral_call_ids_are_nine_letters_or_digits() -> None:
    _, calls = MistralToolParser().parse('[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_an_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="expected one of: hermes, llama3_json, mistral"):
        make_tool_parser("granite")
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"}


@pytest.mark.parametrize(
    ("template", "tool", "reasoning"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None, None),
        ("{{ '<tool_call>' }}{% if tools %}{{ tools }}{% endif %}", "hermes", None),
        ("{{ '<tool_call>\\n<function=' }}{{ '<parameter=' }}", "qwen3_coder", None),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral", None),
        ("{{ '<|python_tag|>' }}{{ '<|eom_id|>' }}", "llama3_json", None),
        ("{{ '<tool_call>' }}{% if enable_thinking %}<think>{% endif %}", "hermes", "qwen3"),
        ("{{ '<｜Assistant｜><think>\\n' }}", None, "qwen3"),
    ],
)
def test_the_chat_template_decides_where_its_markup_is_certain(
    template: str, tool: str | None, reasoning: str | None
) -> None:
    assert detect_tool_parser(template) == tool
    assert detect_reasoning_parser(template) == reasoning
    assert detect_tool_parser(None) is None and detect_reasoning_parser(None) is None


def test_json_nested_deeper_than_the_stack_is_text_not_an_exception() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    outputs = {
        "hermes": '<tool_call>{"name": "get_time", "arguments": {"a": ' + deep + "}}</tool_call>",
        "llama3_json": '{"name": "get_time", "parameters": {"a": ' + deep + "}}",
        "mistral": '[TOOL_CALLS]get_time[ARGS]{"a": ' + deep + "}",
        "pythonic": "[get_time(a=" + deep + ")]",
    }
    for fmt, text in outputs.items():
        assert make_tool_parser(fmt).parse(text) == (text, []), fmt
        content, calls, _ = stream(fmt, [text[: len(text) // 2], text[len(text) // 2 :]])
        assert content == text or calls, fmt
    xml = (
        "<tool_call>\n<function=get_current_weather>\n<parameter=fields>\n"
        + deep
        + "\n</parameter>\n</function>\n</tool_call>"
    )
    _, calls = make_tool_parser("qwen3_coder", tools=TOOLS).parse(xml)
    assert json.loads(calls[0].arguments) == {"fields": deep}  # not an array: kept as text


def test_a_qwen3_coder_text_parameter_streams_before_it_closes() -> None:
    parser = make_tool_parser("qwen3_coder", tools=TOOLS)
    _, deltas = parser.feed('<tool_call>\n<function=write_file>\n<parameter=content>\nline "1"\n')
    assert deltas[0]["function"]["name"] == "write_file"
    assert "".join(d["function"]["arguments"] for d in deltas[1:]) == '{"content": "line \\"1\\"'
    _, more = parser.feed("line 2\n</param")  # the held newline was value after all
    assert "".join(d["function"]["arguments"] for d in more) == "\\nline 2"
    _, last = parser.feed("eter>\n</function>\n</tool_call>", final=True)
    assert json.loads(parser.calls[0].arguments) == {"content": 'line "1"\nline 2'}
    assert "".join(d["function"]["arguments"] for d in last) == '"}'
