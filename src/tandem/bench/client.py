"""OpenAI streaming client for the load generator: per-request timing from SSE events.

Timing contract (per request, seconds, `time.perf_counter` clock):
- TTFT: request written → first SSE event carrying generated text (`text`, `delta.content`
  or `delta.reasoning_content` non-empty).
- ITL: every gap between consecutive text-carrying events (all of them, not a mean).
- e2e: request written → response complete.
Token counts come from the final usage chunk (`stream_options.include_usage`); without usage,
output tokens fall back to the number of text-carrying events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from tandem.bench.http import HttpConnection, request_head


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, object] | str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass(slots=True)
class RequestResult:
    """What one request measured. `status` is the HTTP status, 0 for a transport failure."""

    start_s: float = 0.0
    status: int = 0
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    saw_done: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class SseAccumulator:
    """A `StreamSink` turning an SSE body into a `RequestResult` as bytes arrive."""

    def __init__(self, result: RequestResult, sent_at: float) -> None:
        self.result = result
        self.sent_at = sent_at
        self._buf = b""
        self._last_token_at: float | None = None
        self._error_body = b""

    def on_status(self, status: int) -> None:
        self.result.status = status

    def on_body(self, data: bytes, now: float) -> None:
        if self.result.status != 200:
            self._error_body += data
            return
        buf = self._buf + data
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            self._on_event(buf[:end], now)
            buf = buf[end + 2 :]
        self._buf = buf

    def _on_event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.result.saw_done = True
                return
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError as exc:
                self.result.error = f"bad SSE payload: {exc}"
                return
            self._on_chunk(chunk, now)

    def _on_chunk(self, chunk: _Chunk, now: float) -> None:
        if chunk.error is not None:
            self.result.error = f"stream error: {chunk.error}"
        if chunk.usage is not None:
            usage = chunk.usage
            self.result.prompt_tokens = usage.prompt_tokens
            self.result.output_tokens = usage.completion_tokens
            details = usage.prompt_tokens_details
            self.result.cached_tokens = (details.cached_tokens or 0) if details else 0
        if any(_has_text(c) for c in chunk.choices):
            self.result.num_chunks += 1
            if self._last_token_at is None:
                self.result.ttft_s = now - self.sent_at
            else:
                self.result.itl_s.append(now - self._last_token_at)
            self._last_token_at = now

    def finish(self, now: float) -> None:
        self.result.e2e_s = now - self.sent_at
        if self.result.status != 200 and self.result.error is None:
            self.result.error = self._error_body[:300].decode(errors="replace")
        if self.result.output_tokens == 0:
            self.result.output_tokens = self.result.num_chunks


def _has_text(choice: _Choice) -> bool:
    if choice.text:
        return True
    delta = choice.delta
    return delta is not None and bool(delta.content or delta.reasoning_content)


class ConnectionPool:
    """Keep-alive connections to one server, or a fresh connection per request."""

    def __init__(self, host: str, port: int, *, fresh: bool, timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.fresh = fresh
        self.timeout_s = timeout_s
        self._idle: list[HttpConnection] = []

    async def send(self, path: str, body: bytes, result: RequestResult) -> RequestResult:
        """POST `body` to `path`; fills and returns `result`. Never raises for server errors:
        transport failures become status 0 with the error text."""
        head = request_head("POST", self.host, self.port, path, len(body), not self.fresh)
        conn = None
        sink = None
        try:
            conn = self._idle.pop() if self._idle else None
            if conn is None or conn.is_closed:
                conn = await HttpConnection.open(self.host, self.port, self.timeout_s)
            sink = SseAccumulator(result, time.perf_counter())
            reusable = await conn.request(head, body, sink, self.timeout_s)
            sink.finish(time.perf_counter())
            if reusable and not self.fresh and not conn.is_closed:
                self._idle.append(conn)
            else:
                conn.close()
        except (OSError, TimeoutError) as exc:
            if conn is not None:
                conn.close()
            result.status = 0
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
