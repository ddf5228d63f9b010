"""The Response object and its server-sent events, as OpenAI's Responses API defines them.

`ResponseBuilder` is pure (no I/O): it holds one response's state (id, the request's echoed
fields, the output text so far) and encodes the body and each streamed event. A text
response streams, in order (each event with `type` and an increasing `sequence_number`):

    response.created, response.in_progress,
    response.output_item.added (the assistant message), response.content_part.added,
    response.output_text.delta × N, response.output_text.done, response.content_part.done,
    response.output_item.done, and response.completed (or response.incomplete when the
    output hit max_output_tokens or the context, with incomplete_details).

An error after the stream started is one `error` event and then response.failed.

A model with a reasoning parser (`frontend/pipeline/parsers/reasoning.py`) answers with a
reasoning item first when it reasoned: its events (output_item.added, then
response.reasoning_text.delta × N, response.reasoning_text.done, output_item.done) come at
output_index 0 before the message item's, which then sits at output_index 1 and opens at the
first answer text (`defer_message`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from tandem.protocols.openai_responses import ResponsesRequest

_json = msgspec.json.Encoder()


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's object and events. Not thread-safe; one request."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str) -> None:
        self.req, self.model, self.id = req, model, response_id
        self.created_at = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.status = "in_progress"
        self.text = ""
        self.reasoning: str | None = None  # None: no reasoning item
        # a reasoning model's message item opens at its first answer text, not at the start
        self.defer_message = False
        self._message_open = self._reasoning_done = False
        self.usage: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.completed_at: int | None = None
        self._seq = 0

    # ------------------------------------------------------------------ the object
    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> None:
        """Set the final status from the engine's finish reason and the usage."""
        self.usage = usage
        self.completed_at = int(time.time())
        if finish_reason == "length":
            self.status, self.incomplete_reason = "incomplete", "max_output_tokens"
        else:
            self.status = "completed"

    def fail(self, code: str, message: str) -> None:
        self.status, self.error = "failed", {"code": code, "message": message}

    def message_item(self, *, done: bool) -> dict[str, Any]:
        status = "in_progress" if not done else self._item_status()
        content = [self._part()] if done else []
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def reasoning_item(self, *, done: bool) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": self.reasoning or ""}] if done else []
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": self._item_status() if done else "in_progress",
        }

    def output(self) -> list[dict[str, Any]]:
        message = self.message_item(done=True)
        return [message] if self.reasoning is None else [self.reasoning_item(done=True), message]

    def _item_status(self) -> str:
        return "incomplete" if self.status == "incomplete" else "completed"

    def _part(self, text: str | None = None) -> dict[str, Any]:
        body = self.text if text is None else text
        return {"type": "output_text", "text": body, "annotations": [], "logprobs": []}

    def response(self) -> dict[str, Any]:
        req = self.req
        done = self.status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at if done else None,
            "error": self.error,
            "incomplete_details": (
                {"reason": self.incomplete_reason} if self.incomplete_reason else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": self.output() if done else [],
            "parallel_tool_calls": True
            if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": req.user,
        }

    def body(self) -> bytes:
        return _json.encode(self.response())

    # ------------------------------------------------------------------ the events
    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"

    def _message_index(self) -> int:
        return 0 if self.reasoning is None else 1

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self._message_index(), "content_index": 0}

    def start_events(self) -> bytes:
        """created, in_progress, and (unless deferred) the message item and its text part
        added."""
        started = self._event("response.created", {"response": self.response()})
        started += self._event("response.in_progress", {"response": self.response()})
        return started if self.defer_message else started + self._open_message()

    def _open_message(self) -> bytes:
        self._message_open = True
        return self._close_reasoning() + b"".join(
            (
                self._event(
                    "response.output_item.added",
                    {"output_index": self._message_index(), "item": self.message_item(done=False)},
                ),
                self._event(
                    "response.content_part.added", {**self._where(), "part": self._part("")}
                ),
            )
        )

    def reasoning_event(self, text: str) -> bytes:
        """A piece of reasoning (before any answer text: the message item is not open)."""
        assert not self._message_open, "reasoning after the answer began"
        opened = b""
        if self.reasoning is None:
            self.reasoning = ""
            item = self.reasoning_item(done=False)
            opened = self._event("response.output_item.added", {"output_index": 0, "item": item})
        self.reasoning += text
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return opened + self._event("response.reasoning_text.delta", {**where, "delta": text})

    def _close_reasoning(self) -> bytes:
        if self.reasoning is None or self._reasoning_done:
            return b""
        self._reasoning_done = True
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return self._event(
            "response.reasoning_text.done", {**where, "text": self.reasoning}
        ) + self._event(
            "response.output_item.done",
            {"output_index": 0, "item": self.reasoning_item(done=True)},
        )

    def delta_event(self, text: str) -> bytes:
        opened = b"" if self._message_open else self._open_message()
        self.text += text
        return opened + self._event(
            "response.output_text.delta", {**self._where(), "delta": text, "logprobs": []}
        )

    def end_events(self) -> bytes:
        """text done, part done, item done, then completed / incomplete (call `finish` first)."""
        final = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return b"".join(
            (
                b"" if self._message_open else self._open_message(),
                self._event(
                    "response.output_text.done",
                    {**self._where(), "text": self.text, "logprobs": []},
                ),
                self._event("response.content_part.done", {**self._where(), "part": self._part()}),
                self._event(
                    "response.output_item.done",
                    {"output_index": self._message_index(), "item": self.message_item(done=True)},
                ),
                self._event(final, {"response": self.response()}),
            )
        )

    def error_events(self, code: str, message: str, param: str | None) -> bytes:
        """An `error` event (tandem's error type as its code), then response.failed (whose
        error code is one of OpenAI's: server_error)."""
        self.fail("server_error", f"{code}: {message}")
        error = {"code": code, "message": message, "param": param}
        return self._event("error", error) + self._event(
            "response.failed", {"response": self.response()}
        )
