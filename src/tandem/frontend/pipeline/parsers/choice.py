"""`OutputParser`: one choice's text through its reasoning parser, then its tool-call parser
(so a call written while thinking is reasoning, never a call). What chat completions (and any
other API that answers with tool calls and reasoning) drives per choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tandem.frontend.pipeline.parsers.base import ToolCall, ToolParser
from tandem.frontend.pipeline.parsers.reasoning import ReasoningParser
from tandem.frontend.pipeline.parsers.registry import make_reasoning_parser, make_tool_parser


class ParsedDelta(NamedTuple):
    """What one streamed piece of a choice's text became."""

    reasoning: str  # for `delta.reasoning_content`
    content: str  # for `delta.content`
    tool_calls: list[dict[str, Any]]  # `delta.tool_calls` entries (base.py's shape)


class ParsedOutput(NamedTuple):
    """A whole choice's text, parsed."""

    reasoning: str | None  # None: no reasoning parser, or the model did not reason
    content: str | None  # None: only tool calls (or only reasoning) remain
    tool_calls: list[ToolCall]


class OutputParser:
    """One choice's parsers; `feed` (streaming) and `parse` (whole text) are alternatives.
    Not safe for concurrent use."""

    def __init__(self, tool: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tool, self.reasoning = tool, reasoning

    @classmethod
    def make(
        cls,
        tool_parser: str | None,
        reasoning_parser: str | None,
        *,
        max_calls: int | None = None,
        tools: Sequence[Any] = (),
        prompt_opens_think: bool = False,
    ) -> OutputParser:
        """Parsers by name (None: that parser is off); ValueError for an unknown name."""
        tool = None
        if tool_parser is not None:
            tool = make_tool_parser(tool_parser, max_calls=max_calls, tools=tools)
        reasoning = None
        if reasoning_parser is not None:
            reasoning = make_reasoning_parser(
                reasoning_parser, prompt_opens_think=prompt_opens_think
            )
        return cls(tool, reasoning)

    @property
    def calls(self) -> list[ToolCall]:
        return self.tool.calls if self.tool is not None else []

    def feed(self, text: str, *, final: bool = False) -> ParsedDelta:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final=final)
        calls: list[dict[str, Any]] = []
        if self.tool is not None:
            content, calls = self.tool.feed(content, final=final)
        return ParsedDelta(reasoning, content, calls)

    def parse(self, text: str) -> ParsedOutput:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
        if self.tool is None:
            return ParsedOutput(reasoning, content, [])
        parsed, calls = self.tool.parse(content)
        return ParsedOutput(reasoning, parsed, calls)
