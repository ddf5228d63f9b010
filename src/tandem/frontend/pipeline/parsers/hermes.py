"""The Hermes tool-call format (the default; tandem.frontend.pipeline.tools renders its prompt):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is not a JSON object with a string `name` stays content, as does an
unclosed block at the end of the text; content never carries the markup of a parsed call.
Streamed (`base.py`'s shape), arguments in pieces as the model writes them; the text that
might still become `<tool_call>` is held back until it cannot.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tandem.frontend.pipeline.parsers.base import (
    ToolCall,
    args_delta,
    head_delta,
    partial_suffix,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# up to the arguments' first character: streamed arguments start at the value, not a blank
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def parse_call(body: str) -> ToolCall | None:
    """The call a block's body spells, or None when it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the stack
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except (ValueError, RecursionError):
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """Parses `<tool_call>` blocks. One per choice; `feed` (streaming) and `parse` (whole
    text) are alternatives, not to be mixed on one instance."""

    def __init__(self, *, max_calls: int | None = None, tools: Sequence[Any] = ()) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self.calls: list[ToolCall] = []
        self._buf = ""  # unconsumed text (outside: a possible OPEN prefix; inside: the body)
        self._inside = False
        self._head_sent = False
        self._args_start = 0
        self._args_sent = 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole text; content None when only calls remain."""
        content: list[str] = []
        pos = 0
        while (start := text.find(OPEN, pos)) != -1:
            end = text.find(CLOSE, start + len(OPEN))
            if end == -1:
                break
            call = parse_call(text[start + len(OPEN) : end])
            if call is None:  # not a call: the block stays text
                content.append(text[pos : end + len(CLOSE)])
            else:
                content.append(text[pos:start])
                if self.max_calls is None or len(self.calls) < self.max_calls:
                    self.calls.append(call)
            pos = end + len(CLOSE)
        content.append(text[pos:])
        joined = "".join(content)
        if self.calls:
            joined = joined.strip()
        return (joined or None) if self.calls else joined, self.calls

    # ------------------------------------------------------------------ streaming
    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Content to emit now and tool-call deltas (OpenAI `delta.tool_calls` entries) for
        the next `text`; `final` flushes what was held back (the stream ended)."""
        self._buf += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            if not self._inside:
                start = self._buf.find(OPEN)
                if start == -1:
                    keep = 0 if final else partial_suffix(self._buf, OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start + len(OPEN) :]
                self._inside, self._head_sent, self._args_sent = True, False, 0
                continue
            end = self._buf.find(CLOSE)
            if end == -1:
                if final:  # an unclosed block: text after all, unless its call was announced
                    if not self._head_sent:
                        content.append(OPEN + self._buf)
                    self._buf = ""
                    break
                deltas += self._stream_body(self._buf)
                break
            body = self._buf[:end]
            if not self._head_sent and parse_call(body) is None:  # not a call: text after all
                content.append(OPEN + body + CLOSE)
            else:
                deltas += self._close_block(body)
            self._buf = self._buf[end + len(CLOSE) :]
            self._inside = False
        text_out = "".join(content)
        if self.calls and not text_out.strip():
            text_out = ""  # whitespace between and after calls is not content
        return text_out, deltas

    def _stream_body(self, body: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self._head_sent:
            if self._limit_reached():
                return []
            match = _HEAD.match(body)
            if match is None:
                return []
            name = json.loads(match.group(1))
            self.calls.append(ToolCall(name, ""))
            self._head_sent, self._args_start = True, match.end()
            out.append(self._head_delta())
        safe = body[: len(body) - partial_suffix(body, CLOSE)].rstrip()
        if safe.endswith("}"):  # may be the call object's own closing brace
            safe = safe[:-1].rstrip()
        piece = safe[self._args_start + self._args_sent :]
        if piece:
            self._args_sent += len(piece)
            self.calls[-1].arguments += piece
            out.append(self._args_delta(piece))
        return out

    def _close_block(self, body: str) -> list[dict[str, Any]]:
        if not self._head_sent:
            call = parse_call(body)
            if call is None or self._limit_reached():
                return []
            self.calls.append(call)
            return [self._head_delta(), self._args_delta(call.arguments)]
        if self._limit_reached(1):
            return []
        raw = body.rstrip()
        raw = raw[:-1] if raw.endswith("}") else raw
        rest = raw.rstrip()[self._args_start + self._args_sent :]
        if not rest:
            return []
        self.calls[-1].arguments += rest
        return [self._args_delta(rest)]

    def _limit_reached(self, slack: int = 0) -> bool:
        return self.max_calls is not None and len(self.calls) - slack >= self.max_calls

    def _head_delta(self) -> dict[str, Any]:
        return head_delta(len(self.calls) - 1, self.calls[-1])

    def _args_delta(self, piece: str) -> dict[str, Any]:
        return args_delta(len(self.calls) - 1, piece)
