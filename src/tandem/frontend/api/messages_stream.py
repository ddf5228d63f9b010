"""The Anthropic Message of a generate request: one body, or its stream of events.

Stream (Anthropic's "Streaming Messages"), each `event: <type>` + `data: <json>`:
`message_start` (the message with empty content and the input usage), then per content
block `content_block_start`, its deltas (`thinking_delta`, `text_delta`, or `input_json_delta`
pieces of a tool call's input as the model writes them) and `content_block_stop`; a `ping` after the
first block starts; `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`.
An error after the stream started is an `error` event. Reasoning and tool calls come from the
model's parsers (`pipeline.parsers.choice.OutputParser`, as chat's): reasoning becomes
`thinking` blocks (`thinking_delta`) when `thinking` asked for them (else the template was
told not to think, and thinking a model writes anyway is dropped), each call a `tool_use`
block (`toolu_` id).

Usage: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` the ones that were (Anthropic counts the two apart; their sum is
the prompt), `cache_creation_input_tokens` 0 (no explicit cache writes).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from tandem.errors import ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.pipeline.parsers.base import ToolCall
from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.pipeline.preprocess import Prepared

_json = msgspec.json.Encoder()
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


def usage(prepared: Prepared, state: ChoiceState) -> dict[str, Any]:
    cached = state.num_cached_tokens or 0
    return {
        "input_tokens": sum(prepared.prompt_lens) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": state.num_tokens,
        "service_tier": "standard",
    }


def stop_reason(state: ChoiceState, parser: OutputParser | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if state.stop_string is not None:
        return "stop_sequence", state.stop_string
    if parser is not None and parser.calls and state.finish_reason == "stop":
        return "tool_use", None
    return STOP_REASONS.get(state.finish_reason or "stop", "end_turn"), None


class MessageOutput:
    """The Messages answer of one choice (`Output` of the generate pipeline). One per request;
    not safe for concurrent use."""

    __slots__ = (
        "_block",
        "_id",
        "_index",
        "_model",
        "_parser",
        "_pinged",
        "_prepared",
        "_show_thinking",
        "_state",
        "_tool_ids",
        "keep_text",
    )

    def __init__(
        self,
        message_id: str,
        model: str,
        prepared: Prepared,
        state: ChoiceState,
        parser: OutputParser | None,
        *,
        stream: bool,
        show_thinking: bool = True,
    ) -> None:
        self._id, self._model = message_id, model
        self._show_thinking = show_thinking  # False: thinking is parsed out and dropped
        self._prepared, self._state, self._parser = prepared, state, parser
        self.keep_text = not stream
        self._index = -1  # the open content block's index (-1: none yet)
        self._block: str | None = None  # its type (thinking, text, tool_use); None: closed
        self._pinged = False
        self._tool_ids: dict[int, str] = {}  # parser's call index -> toolu_ id

    def message(self, content: list[dict[str, Any]], reason: str | None, seq: str | None) -> Any:
        u = usage(self._prepared, self._state)
        if reason is None:  # message_start: nothing generated yet
            u["output_tokens"] = 0
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": u,
        }

    # ------------------------------------------------------------------ stream
    def head(self) -> bytes:
        return sse(
            "message_start", {"type": "message_start", "message": self.message([], None, None)}
        )

    def chunks(self, batch: list[Event]) -> bytes:
        out: list[bytes] = []
        for _, text, _, finish, _ in batch:
            reasoning, calls = "", list[dict[str, Any]]()
            if self._parser is not None:
                reasoning, text, calls = self._parser.feed(text, final=finish is not None)
            if reasoning and self._show_thinking:
                self._open(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if text:
                self._open(out, "text", {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": text}
                out.append(self._delta(delta))
            for call in calls:
                self._tool_delta(out, call)
        return b"".join(out)

    def tail(self) -> bytes:
        out: list[bytes] = []
        self._close(out)
        if not self._pinged:
            out.append(sse("ping", {"type": "ping"}))
        reason, seq = stop_reason(self._state, self._parser)
        u = usage(self._prepared, self._state)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        out.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": u}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def failed(self, exc: ServingError) -> bytes:
        """Anthropic's `error` event (the stream then ends)."""
        return sse("error", http_errors.anthropic_error(exc, self._id))

    def _tool_delta(self, out: list[bytes], call: dict[str, Any]) -> None:
        """One OpenAI-shaped tool-call delta of the parser as Messages events."""
        if "id" in call:  # a new call: its block starts
            tool_id = self._tool_ids.setdefault(call["index"], new_tool_use_id())
            name = call["function"]["name"]
            block = {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
            self._close(out)
            self._open(out, "tool_use", block)
        piece = call["function"].get("arguments")
        if piece:
            out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))

    def _open(self, out: list[bytes], kind: str, block: dict[str, Any]) -> None:
        if self._block == kind and kind != "tool_use":
            return
        self._close(out)
        self._index += 1
        self._block = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        out.append(sse("content_block_start", start))
        if not self._pinged:
            self._pinged = True
            out.append(sse("ping", {"type": "ping"}))

    def _close(self, out: list[bytes]) -> None:
        if self._block is not None:
            out.append(
                sse("content_block_stop", {"type": "content_block_stop", "index": self._index})
            )
            self._block = None

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return sse("content_block_delta", event)

    # ------------------------------------------------------------------ unary
    def body(self) -> bytes:
        text: str | None = "".join(self._state.text_parts)
        reasoning: str | None = None
        calls: list[ToolCall] = []
        if self._parser is not None and text is not None:
            reasoning, text, calls = self._parser.parse(text)
        blocks: list[dict[str, Any]] = []
        if reasoning and self._show_thinking:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text:
            blocks.append({"type": "text", "text": text})
        for call in calls:
            args = json.loads(call.arguments or "{}")  # a parsed call's is a JSON object
            blocks.append(
                {"type": "tool_use", "id": new_tool_use_id(), "name": call.name, "input": args}
            )
        reason, seq = stop_reason(self._state, self._parser)
        return _json.encode(self.message(blocks, reason, seq))
