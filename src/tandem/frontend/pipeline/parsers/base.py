"""What every tool-call parser shares: the parsed call (`ToolCall`), the `ToolParser`
protocol the chat output drives, and the OpenAI delta shapes.

A parsed call is a plain value: `name`, `arguments` (a JSON object as text, as OpenAI sends it)
and `id`. Streaming follows OpenAI's shape: per call, a first delta with index, id, type and
function.name (arguments ""), then the arguments in pieces whose concatenation is the call's
`arguments`.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_call_id() -> str:
    """Mistral's chat templates refuse tool call ids that are not 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(slots=True)
class ToolCall:
    """One function call the model made."""

    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser(Protocol):
    """Parses one choice's text. `feed` (streaming) and `parse` (whole text) are
    alternatives, not to be mixed on one instance; not safe for concurrent use.
    Neither raises on what the model wrote: text that is not a well-formed call stays
    content."""

    calls: list[ToolCall]  # the calls so far (streaming: announced ones, maybe still growing)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole text; content None when only calls remain. A text
        with any malformed or unfinished call is all content, with no calls."""
        ...

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Content to emit now and `delta.tool_calls` entries for the next piece of text;
        `final` (the stream ended) flushes what was held back. Text that might still become
        call markup is held until it cannot; once a call was announced it stays a call (a
        stream cut inside it ends with the arguments written so far)."""
        ...


def head_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }


def args_delta(index: int, piece: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": piece}}


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
