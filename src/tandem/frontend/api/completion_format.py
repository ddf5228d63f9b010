"""OpenAI response bodies and SSE chunks for chat and text completions.

Chunks are the hot path: the fixed head of every chunk (id, object, created, model) is
encoded once per request and only the choice is encoded per chunk.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tandem.frontend.pipeline.generate import cached_tokens
from tandem.frontend.pipeline.parsers.choice import OutputParser
from tandem.frontend.pipeline.postprocess import ChoiceState
from tandem.frontend.pipeline.preprocess import Prepared

_json = msgspec.json.Encoder()
# what follows the text in the common chunks (`ResponseFormat.chunk`)
_TEXT_END = b',"logprobs":null,"finish_reason":null}]}\n\n'
_DELTA_END = b'},"logprobs":null,"finish_reason":null}]}\n\n'


class ResponseFormat:
    """Encodes one request's chunks and final body; `bind()` before use."""

    __slots__ = ("_head", "_tail", "_text_heads", "chat", "created", "model", "request_id")

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.request_id = ""
        self.model = ""
        self.created = 0
        self._head = b""
        self._tail = b"]}\n\n"
        self._text_heads: dict[int, bytes] = {}  # choice index -> a text chunk up to its text

    def bind(self, request_id: str, model: str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        fixed = _json.encode(
            {"id": request_id, "object": obj, "created": self.created, "model": model}
        )
        self._head = b"data: " + fixed[:-1] + b',"choices":['
        self._text_heads = {}

    def role_chunk(self, index: int) -> bytes:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._head + _json.encode(choice) + self._tail

    def chunk(
        self,
        index: int,
        text: str,
        logprobs: list[dict[str, Any]] | None,
        finish_reason: str | None,
        usage: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
    ) -> bytes:
        plain = text and finish_reason is None and logprobs is None and usage is None
        if not plain or tool_calls or reasoning:
            return self._chunk(index, text, logprobs, finish_reason, usage, tool_calls, reasoning)
        # the common chunk (text, nothing else): the bytes `_chunk` writes, from a template
        head = self._text_heads.get(index)
        if head is None:
            what = b'"delta":{"content":' if self.chat else b'"text":'
            head = self._text_heads[index] = self._head + b'{"index":%d,%s' % (index, what)
        return head + _json.encode(text) + (_DELTA_END if self.chat else _TEXT_END)

    def _chunk(
        self,
        index: int,
        text: str,
        logprobs: list[dict[str, Any]] | None,
        finish_reason: str | None,
        usage: dict[str, Any] | None,
        tool_calls: list[dict[str, Any]] | None,
        reasoning: str = "",
    ) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or (finish_reason is None and not tool_calls and not reasoning):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            lp = {"content": logprobs} if logprobs is not None else None
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": finish_reason,
            }
        else:
            lp = completion_logprobs(logprobs) if logprobs is not None else None
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        if usage is None:
            return self._head + _json.encode(choice) + self._tail
        return self._head + _json.encode(choice) + b'],"usage":' + _json.encode(usage) + b"}\n\n"

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        return self._head + b'],"usage":' + _json.encode(usage) + b"}\n\n"

    def full_response(
        self,
        states: list[ChoiceState],
        usage: dict[str, Any],
        parsers: list[OutputParser] | None = None,
    ) -> bytes:
        choices = [
            self._full_choice(s, parsers[i] if parsers else None) for i, s in enumerate(states)
        ]
        body = {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }
        return _json.encode(body)

    def _full_choice(
        self, state: ChoiceState, parser: OutputParser | None = None
    ) -> dict[str, Any]:
        text = "".join(state.text_parts)
        logprobs = state.all_logprobs
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = state.finish_reason
            if parser is not None:
                reasoning, content, calls = parser.parse(text)
                message["content"] = content
                if parser.reasoning is not None:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [c.to_dict() for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            return {
                "index": state.index,
                "message": message,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish,
            }
        return {
            "index": state.index,
            "text": text,
            "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": state.finish_reason,
        }


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat-style logprob entries → the legacy completions shape."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def usage(
    prepared: Prepared, states: list[ChoiceState], *, at: tuple[ChoiceState, int] | None = None
) -> dict[str, Any]:
    """The request's usage; `at` (state, its token count then): as of one of its chunks, for
    `continuous_usage_stats` (the state may already have taken later chunks of its batch)."""
    prompt = sum(prepared.prompt_lens)
    completion = sum(s.num_tokens for s in states)
    if at is not None:
        completion += at[1] - at[0].num_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(prepared, states)},
    }
