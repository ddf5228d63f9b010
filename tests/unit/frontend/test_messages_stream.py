"""`MessageOutput`: the Messages event sequence, each event validated against the official
`anthropic` SDK's types and accumulated by the SDK's own stream accumulator into the same
Message the unary body gives; stop reasons, usage, tool_use blocks streamed as
input_json_delta, and the error event."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace
from typing import Any

import pydantic
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from tests.support.smollm2 import smollm2_gguf

from tandem.errors import (
    DeadlineExceeded,
    EngineError,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    NoWorkersAvailable,
    Overloaded,
    PeerGone,
    RateLimited,
    Unauthorized,
)
from tandem.frontend import errors as http_errors
from tandem.frontend.api.messages_stream import MessageOutput
from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.postprocess import ChoiceState
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.protocols.engine import EngineOutput
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@functools.cache
def _tok() -> ModelTokenizer:
    return load_tokenizer(f"gguf:{smollm2_gguf()}")


def _run(
    text: str,
    *,
    stream: bool,
    stops: tuple[str, ...] = (),
    finish: str = "stop",
    tools: bool = False,
    reasoning: bool = False,
) -> tuple[bytes, MessageOutput]:
    """`text` generated one token per engine output (the first reports 3 cached prompt
    tokens), through a MessageOutput: the stream bytes (or the body)."""
    tok = _tok()
    state = ChoiceState(0, tok, list(stops))
    prepared = Prepared(
        request_id="msg_1", model=SimpleNamespace(name="m"), requests=[], prompt_lens=[10]
    )  # type: ignore[arg-type]
    parser = None
    if tools or reasoning:
        parser = OutputParser.make("hermes" if tools else None, "qwen3" if reasoning else None)
    out = MessageOutput("msg_1", "m", prepared, state, parser, stream=stream)
    ids = tok.encode(text, add_special_tokens=False)
    data, started = b"", False
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        state.process(
            EngineOutput(
                token_ids=[token],
                num_cached_tokens=3 if i == 0 else None,
                finish_reason=finish if last else None,
            ),
            keep_text=not stream,
        )
        if stream:
            if not started:
                data, started = out.head(), True
            event = (state, state.delta_text, None, state.finish_reason, state.num_tokens)
            data += out.chunks([event])
        if state.finish_reason is not None:
            break
    return (data + out.tail() if stream else out.body()), out


def _events(stream: bytes) -> list[dict[str, Any]]:
    """SSE frames → data objects, each checked against the SDK's event types and its
    `event:` line."""
    out = []
    for frame in stream.decode().split("\n\n"):
        if frame:
            event_line, data_line = frame.split("\n")
            data = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {data['type']}"
            if data["type"] not in ("ping", "error"):
                EVENTS.validate_python(data)
            out.append(data)
    return out


def _accumulated(events: list[dict[str, Any]]) -> Message:
    """The Message the SDK's stream helper builds from the events."""
    snapshot, bufs = None, {}
    for data in events:
        if data["type"] != "ping":
            snapshot = accumulate_event(
                event=EVENTS.validate_python(data), current_snapshot=snapshot, json_bufs=bufs
            )
    assert snapshot is not None
    return Message.model_validate(snapshot.model_dump())


def test_a_text_stream_has_anthropics_event_sequence_and_usage() -> None:
    stream, _ = _run("Hello there, friend.", stream=True)
    events = _events(stream)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["usage"]["input_tokens"] == 7 and start["usage"]["cache_read_input_tokens"] == 3
    message = _accumulated(events)
    assert message.content[0].text == "Hello there, friend."  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == deltas and message.usage.input_tokens == 7


def test_stream_and_body_give_the_same_message() -> None:
    stream, _ = _run("Hello there, friend.", stream=True)
    body, _ = _run("Hello there, friend.", stream=False)
    streamed = _accumulated(_events(stream)).model_dump(exclude_none=True)
    unary = Message.model_validate_json(body).model_dump(exclude_none=True)
    assert streamed == unary


def test_a_stop_sequence_is_reported_with_its_reason() -> None:
    body, _ = _run("one two END three", stream=False, stops=["END"])
    message = Message.model_validate_json(body)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    assert message.content[0].text == "one two "  # type: ignore[union-attr]


def test_the_length_limit_is_max_tokens() -> None:
    body, _ = _run("one two three", stream=False, finish="length")
    assert Message.model_validate_json(body).stop_reason == "max_tokens"


def test_a_tool_call_streams_as_a_tool_use_block_with_input_json_deltas() -> None:
    stream, _ = _run("Checking." + CALL, stream=True, tools=True)
    events = _events(stream)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["id"].startswith("toolu_") and starts[1]["name"] == "get_weather"
    pieces = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 1]
    assert len(pieces) > 1 and all(p["type"] == "input_json_delta" for p in pieces)
    message = _accumulated(events)
    assert message.stop_reason == "tool_use"
    assert message.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]


def test_a_unary_tool_call_is_a_tool_use_block() -> None:
    body, _ = _run(CALL, stream=False, tools=True)
    message = Message.model_validate_json(body)
    assert message.stop_reason == "tool_use" and len(message.content) == 1
    block = message.content[0]
    assert block.type == "tool_use" and block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_")


def test_an_error_after_the_start_is_an_error_event() -> None:
    _, out = _run("Hi", stream=True)
    (event,) = _events(out.failed(Overloaded("busy")))
    assert event["type"] == "error"
    assert event["error"] == {"type": "overloaded_error", "message": "busy"}
    (event,) = _events(out.failed(InvalidRequest("bad")))
    assert event["error"]["type"] == "invalid_request_error"


def test_reasoning_streams_as_a_thinking_block_before_the_text() -> None:
    stream, _ = _run("<think>Two and two.</think>Four.", stream=True, reasoning=True)
    events = _events(stream)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    kinds = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta"}
    message = _accumulated(events)
    assert message.content[0].thinking == "Two and two."  # type: ignore[union-attr]
    assert message.content[1].text == "Four."  # type: ignore[union-attr]
    body, _ = _run("<think>Two and two.</think>Four.", stream=False, reasoning=True)
    unary = Message.model_validate_json(body).model_dump(exclude_none=True)
    assert unary == message.model_dump(exclude_none=True)


def test_errors_have_anthropics_statuses_and_types() -> None:
    cases = [
        (InvalidRequest("x"), 400, "invalid_request_error"),
        (Unauthorized("x"), 401, "authentication_error"),
        (Forbidden("x"), 403, "permission_error"),
        (ModelNotFound("x"), 404, "not_found_error"),
        (RateLimited("x"), 429, "rate_limit_error"),
        (Overloaded("x"), 529, "overloaded_error"),
        (NoWorkersAvailable("x"), 529, "overloaded_error"),
        (PeerGone("x"), 503, "api_error"),
        (DeadlineExceeded("x"), 504, "timeout_error"),
        (EngineError("x"), 500, "api_error"),
    ]
    for exc, status, kind in cases:
        assert http_errors.anthropic_status(exc) == status, exc
        assert http_errors.anthropic_error(exc)["error"]["type"] == kind, exc
