"""`ResponseBuilder`: the Responses API's event sequence, each event validated against the
official SDK's own types (pydantic, strict shapes), sequence numbers, and the final object."""

from __future__ import annotations

import json
from typing import Any

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from tandem.frontend.api.responses.events import ResponseBuilder
from tandem.protocols.openai_responses import ResponsesRequest

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
USAGE = {
    "input_tokens": 7,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 2,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 9,
}


def _parse(stream: bytes) -> list[dict[str, Any]]:
    """SSE frames → their data objects, checking each `event:` line names the data's type."""
    out = []
    for frame in stream.decode().split("\n\n"):
        if not frame:
            continue
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        EVENTS.validate_python(data)  # raises on any field the SDK's type does not accept
        out.append(data)
    return out


def _builder(**kw: Any) -> ResponseBuilder:
    req = ResponsesRequest(model="m", input="hi", instructions="be brief", **kw)
    return ResponseBuilder(req, "m", "resp_1")


def test_a_completed_text_stream_has_openais_event_sequence() -> None:
    b = _builder()
    stream = b.start_events() + b.delta_event("Hel") + b.delta_event("lo")
    b.finish("stop", USAGE)
    events = _parse(stream + b.end_events())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    assert events[6]["text"] == "Hello"
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {events[2]["item"]["id"]}
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello"
    assert final.id == "resp_1" and final.instructions == "be brief"
    assert final.usage is not None and final.usage.total_tokens == 9


def test_an_output_cut_by_max_output_tokens_ends_incomplete() -> None:
    b = _builder(max_output_tokens=2)
    stream = b.start_events() + b.delta_event("ab")
    b.finish("length", USAGE)
    events = _parse(stream + b.end_events())
    assert events[-1]["type"] == "response.incomplete"
    response = Response.model_validate(events[-1]["response"])
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert events[-2]["item"]["status"] == "incomplete"


def test_an_error_mid_stream_is_an_error_event_then_response_failed() -> None:
    b = _builder()
    stream = b.start_events() + b.delta_event("x")
    events = _parse(stream + b.error_events("peer_gone", "worker lost", None))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "worker lost"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error is not None


def test_the_body_is_a_response_object() -> None:
    b = _builder(metadata={"k": "v"}, temperature=0.0)
    b.text = "done"
    b.finish("stop", USAGE)
    response = Response.model_validate_json(b.body())
    assert response.object == "response" and response.output_text == "done"
    assert response.metadata == {"k": "v"} and response.temperature == 0.0
    assert response.output[0].type == "message"


def test_reasoning_is_an_item_before_the_message_and_a_cut_leaves_both_incomplete() -> None:
    b = _builder()
    b.defer_message = True  # a model with a reasoning parser
    stream = b.start_events() + b.reasoning_event("Think") + b.reasoning_event("ing.")
    stream += b.delta_event("Hi")
    b.finish("stop", USAGE)
    events = _parse(stream + b.end_events())
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    assert events[5]["text"] == "Thinking."
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "Hi"

    cut = _builder()
    cut.defer_message = True
    stream = cut.start_events() + cut.reasoning_event("Still thinking")
    cut.finish("length", USAGE)
    events = _parse(stream + cut.end_events())
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete"
    assert [(item.type, item.status) for item in final.output] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]
