"""Reasoning parsers: a model's `<think>...</think>` moved out of the content into
`reasoning_content` (a whole text, or streamed deltas), tags never in either.

- `deepseek_r1`: the output starts inside reasoning (DeepSeek-R1's template ends the prompt
  with `<think>`, so the model writes only `</think>`); a `<think>` the model writes itself at
  the start is dropped. An output without `</think>` is all reasoning (cut while thinking).
- `qwen3`: reasoning only where it is opened: by `<think>` at the start of the output, or by
  the prompt ending in `<think>` (templates of thinking-only models put it there). With
  `chat_template_kwargs.enable_thinking=false` the template closes the think block itself
  and the output is all content.

Content starts after `</think>` and the blanks that follow it. A parser is made per choice:
`feed` and `parse` are alternatives, not to be mixed on one instance.
"""

from __future__ import annotations

from tandem.frontend.pipeline.parsers.base import partial_suffix

THINK, END_THINK = "<think>", "</think>"


class ReasoningParser:
    """Splits one choice's text into (reasoning, content). `in_reasoning`: the output starts
    inside a think block."""

    def __init__(self, *, in_reasoning: bool) -> None:
        self._state = "start"  # start -> reasoning -> content (start: nothing decided yet)
        self._in_reasoning = in_reasoning
        self._buf = ""
        self.has_reasoning = False  # some reasoning text was seen

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there was none, content) of a whole text."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning if self.has_reasoning else None), content

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) to emit now for the next piece of the output; `final`
        flushes what was held back (a possible tag's start)."""
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if not final and THINK.startswith(head):
                return "", ""  # blanks or a part of "<think>": undecided
            if head.startswith(THINK):
                self._buf, self._state = head[len(THINK) :], "reasoning"
            else:
                self._state = "reasoning" if self._in_reasoning else "content"
        if self._state == "reasoning":
            end = self._buf.find(END_THINK)
            if end == -1:
                keep = 0 if final else partial_suffix(self._buf, END_THINK)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
            else:
                reasoning, self._buf = self._buf[:end], self._buf[end + len(END_THINK) :]
                self._state = "after"
            self.has_reasoning = self.has_reasoning or bool(reasoning)
        if self._state == "after":  # blanks between </think> and the answer are neither
            self._buf = self._buf.lstrip()
            if self._buf or final:
                self._state = "content"
        if self._state == "content":
            content, self._buf = self._buf, ""
        return reasoning, content


def thinking_disabled(template_kwargs: dict[str, object] | None) -> bool:
    """The request switched thinking off (`enable_thinking: false`, or DeepSeek's
    `thinking: false`) in chat_template_kwargs."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def prompt_opens_think(prompt: str) -> bool:
    """The rendered prompt leaves the model inside a think block."""
    return prompt.rstrip().endswith(THINK)
