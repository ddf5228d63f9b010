"""The frontend's token path in batches: `EngineStreamer.stream_batches` hands on every output
that has already arrived in one batch (in order, ending at the finished one), across a
migration too; `TokenTimer.tokens` counts a batch's chunks as the ITLs the client sees; a long
prompt's first token is flushed at once."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from tandem.errors import PeerGone
from tandem.frontend.api.chat import ChatOutput
from tandem.frontend.api.completion_format import ResponseFormat
from tandem.frontend.api.responses.endpoint import ResponsesOutput
from tandem.frontend.api.responses.events import ResponseBuilder
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.observability.metrics import FrontendMetrics, TokenTimer
from tandem.frontend.observability.request_stats import RequestStatsCollector
from tandem.frontend.pipeline.generate import FLUSH_FIRST_TOKEN_PROMPT_TOKENS as FLUSH_AT
from tandem.frontend.pipeline.generate import stream_events
from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.watchdog import StallConfig
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode,
)
from tandem.protocols.openai_responses import ResponsesRequest
from tandem.router.base import RouteDecision


class ScriptedStream:
    """A request-plane stream whose payloads arrive in the given bursts: each burst lands in
    the buffer at once, when the reader has to wait; `next_ready` takes what is buffered.
    A burst of None breaks the stream (the worker died)."""

    def __init__(self, bursts: list[list[bytes] | None]) -> None:
        self._bursts = deque(bursts)
        self._buf: deque[bytes] = deque()
        self.closed = False

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> bytes:
        if not self._buf:
            await asyncio.sleep(0)
            if not self._bursts:
                raise StopAsyncIteration
            burst = self._bursts.popleft()
            if burst is None:
                raise PeerGone("worker died")
            self._buf.extend(burst)
        return self._buf.popleft()

    def next_ready(self) -> bytes | None:
        return self._buf.popleft() if self._buf else None

    async def aclose(self) -> None:
        self.closed = True


class ScriptedClient:
    """Gives each stream opened the next script; records the requests."""

    def __init__(self, scripts: list[list[list[bytes] | None]]) -> None:  # RequestClient
        self._scripts = deque(scripts)
        self.requests: list[PreprocessedRequest] = []
        self.streams: list[ScriptedStream] = []

    def stream(self, address: str, path: str, payload: bytes, **_: object) -> ScriptedStream:
        self.requests.append(decode_request(payload))
        self.streams.append(ScriptedStream(self._scripts.popleft()))
        return self.streams[-1]

    async def close(self) -> None:
        pass


class TwoWorkers:
    """A router over w0 and w1 that honours `exclude` (a migration leaves the lost one)."""

    def __init__(self) -> None:
        self.first_tokens: list[str] = []
        self.finished: list[tuple[str, int | None]] = []  # (request id, tokens it made there)

    async def route(
        self, request: PreprocessedRequest, exclude: frozenset[str] = frozenset()
    ) -> RouteDecision:
        worker = next(w for w in ("w0", "w1") if w not in exclude)
        return RouteDecision(instance_id=worker, address=f"{worker}:1")

    def on_first_token(self, request_id: str) -> None:
        self.first_tokens.append(request_id)

    def on_finish(self, request_id: str, output_tokens: int | None = None) -> None:
        self.finished.append((request_id, output_tokens))


def _out(token: int, finish: str | None = None) -> bytes:
    return encode(EngineOutput(token_ids=[token], finish_reason=finish))


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=7)
    )


async def _batches(streamer: EngineStreamer, router: TwoWorkers) -> list[list[list[int]]]:
    return [
        [out.token_ids for out in batch]
        async for batch in streamer.stream_batches(_request(), router)
    ]


@pytest.mark.parametrize("stall", [StallConfig(), StallConfig(stall_timeout_s=0)])
async def test_every_output_already_arrived_comes_in_one_batch(stall: StallConfig) -> None:
    """Bursts of 1, 4 and 2 outputs give batches of 1, 4 and 2, in order; the finished
    output ends its batch and the stream (what follows it is never read)."""
    client = ScriptedClient([[[_out(10)], [_out(11), _out(12), _out(13), _out(14)],
                              [_out(15), _out(16, "length"), _out(99)]]])  # fmt: skip
    router = TwoWorkers()
    streamer = EngineStreamer(client, "p", stall=stall)
    assert await _batches(streamer, router) == [[[10]], [[11], [12], [13], [14]], [[15], [16]]]
    assert router.first_tokens == ["r"] and client.streams[0].closed
    flat = EngineStreamer(ScriptedClient([[[_out(1), _out(2)], [_out(3, "stop")]]]), "p")
    outputs = flat.stream(_request(), router)
    assert [o.token_ids async for o in outputs] == [[1], [2], [3]]  # one at a time
    await streamer.close()
    await flat.close()


async def test_a_migration_continues_after_every_output_of_the_batches_taken() -> None:
    """The worker dies after two batches (3 outputs): the continuation on the other worker
    carries all three generated tokens and the caller sees one unbroken stream."""
    client = ScriptedClient(
        [
            [[_out(10)], [_out(11), _out(12)], None],
            [[_out(13), _out(14)], [_out(15), _out(16, "length")]],
        ]
    )
    streamer = EngineStreamer(client, "p", migration_limit=1)
    router = TwoWorkers()
    batches = await _batches(streamer, router)
    assert [t for batch in batches for ids in batch for t in ids] == [10, 11, 12, 13, 14, 15, 16]
    # each dispatch settles its fair-share charge by the tokens it made (router/queue.py)
    assert [n for _, n in router.finished] == [3, 4]
    moved = client.requests[1]
    assert moved.token_ids == [1, 2, 3, 10, 11, 12] and moved.stop.max_tokens == 4
    await streamer.close()


def test_a_batch_of_chunks_counts_its_first_gap_and_zero_for_the_rest() -> None:
    """Five chunks in one write after a first one: the histogram and the planner's interval
    row get 5 ITLs, one the measured gap and four of 0 s; a first batch of 3 counts TTFT once
    and 2 ITLs of 0 s."""
    metrics = FrontendMetrics(interval=RequestStatsCollector("pool"))
    timer = TokenTimer(metrics, "m")
    timer.tokens(1)
    timer.tokens(5)
    series = metrics.itl.child("m")
    assert sum(series[:-1]) == 5 and series[0] >= 4  # four in the lowest bucket (le=0.001)
    assert metrics.interval is not None
    row = metrics.interval.row("m")
    assert row.num_itl == 5 and row.sum_itl_ms == pytest.approx(series[-1] * 1000.0)
    other = TokenTimer(metrics, "n")
    other.tokens(3)
    assert sum(metrics.itl.child("n")[:-1]) == 2 and metrics.interval.row("n").num_itl == 2


class RecordingResponse:
    """What `stream_events` writes, and where the flushes fall among the writes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start_stream(self) -> None:
        self.calls.append("head")

    async def write(self, data: bytes) -> None:
        self.calls.append("write")

    def flush(self) -> None:
        self.calls.append("flush")

    async def end_stream(self) -> None:
        self.calls.append("end")


@pytest.mark.parametrize(("prompt_tokens", "flushed"), [(64, False), (FLUSH_AT, True)])
async def test_a_long_prompts_first_token_is_flushed_at_once(
    prompt_tokens: int, flushed: bool
) -> None:
    """A stream of a long prompt sends its first token right after writing it (not after the
    loop iteration's other callbacks: that wait is TTFT); a short one's rides the
    iteration's coalesced write. Later tokens are never flushed one by one."""
    state = ChoiceState(0, None, [])

    async def events() -> AsyncIterator[list[Event]]:
        for batch in ([(state, "a", None, None, 1)], [(state, "b", None, None, 2)]):
            yield batch
        yield [(state, "c", None, "length", 3)]

    prepared = SimpleNamespace(prompt_lens=[prompt_tokens], tool_parser=None, reasoning_parser=None)
    req = SimpleNamespace(stream_options=None, stream=True)
    fmt = ResponseFormat(chat=False)
    fmt.bind("cmpl-1", "m")
    response = RecordingResponse()
    timer = TokenTimer(FrontendMetrics(), "m")
    output = ChatOutput(req, prepared, [state], fmt)
    await stream_events(response, prepared, events(), output, timer)
    expected = ["head", "write", *(["flush"] if flushed else []), "write", "write", "write", "end"]
    assert response.calls == expected


@pytest.mark.parametrize(("prompt_tokens", "flushed"), [(64, False), (FLUSH_AT, True)])
async def test_a_long_prompts_first_delta_is_flushed_at_once_in_responses(
    prompt_tokens: int, flushed: bool
) -> None:
    """/v1/responses streams flush a long prompt's first text delta the same way."""
    state = ChoiceState(0, None, [])

    async def events() -> AsyncIterator[list[Event]]:
        yield [(state, "a", None, None, 1), (state, "b", None, None, 2)]
        yield [(state, "c", None, "stop", 3)]

    prepared = SimpleNamespace(prompt_lens=[prompt_tokens], reasoning_parser=None)
    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"), "m", "resp_1")
    response = RecordingResponse()
    timer = TokenTimer(FrontendMetrics(), "m")
    output = ResponsesOutput(prepared, state, builder, lambda b: None)
    await stream_events(response, prepared, events(), output, timer)
    expected = ["head", "write", "write", *(["flush"] if flushed else []), "write", "write", "end"]
    assert response.calls == expected  # start events, the first batch's deltas, ..., end events
