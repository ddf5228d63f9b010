"""The generate pipeline every generate endpoint runs: admit → preprocess → route and stream
→ stream or collect → account.

- admit: `admission.slots(n)` holds one in-flight slot per engine request (503 past the bound);
- preprocess: `preprocess(...)` turns a chat or completions request into engine requests
  (chat template, tokenization, limits, images);
- route and stream: `run(...)` opens the engine streams over the request plane, with
  migration (`Streamer`), and turns their outputs into choice events;
- stream or collect: the endpoint's `Output` encodes the events, as SSE chunks written as
  they come (headers only once the first output arrived, so routing failures still get a
  proper status code) or as one body once the last arrived;
- account: the frontend's metrics (arrivals, TTFT/ITL, tokens, disconnects, failures).

Chat and completions (`api.chat`) and `/v1/responses` (`api.responses`) differ only in their
`Output`; `/v1/embeddings` admits, routes and accounts its single call itself.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager, aclosing
from typing import TYPE_CHECKING, Protocol

from tandem.errors import ServingError
from tandem.frontend.http.message import ClientDisconnected, HttpRequest, HttpResponse
from tandem.frontend.models import ServedModel
from tandem.frontend.observability.metrics import FrontendMetrics, TokenTimer, count_as
from tandem.frontend.pipeline.admission import Admission
from tandem.frontend.pipeline.choice_events import Events, engine_events
from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.pipeline.preprocess import Prepared, preprocess_chat, preprocess_completion
from tandem.frontend.pipeline.streamer import Streamer
from tandem.multimodal.loader import ImageLoader
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest
from tandem.runtime import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import Span

PIN_HEADER = "x-worker-instance-id"  # a request pinned to one worker (tests, debugging)

# a stream of a prompt this long writes its first token at once rather than after every
# other callback of the loop iteration (its TTFT), as the request plane writes its REQUEST
# (runtime/tcp/frame.FLUSH_NOW_BYTES); a short one's rides the iteration's coalesced write
FLUSH_FIRST_TOKEN_PROMPT_TOKENS = 4096


def flushes_first_token(prepared: Prepared) -> bool:
    """Whether a stream of `prepared` sends its first token at once (a long prompt's)."""
    return sum(prepared.prompt_lens) >= FLUSH_FIRST_TOKEN_PROMPT_TOKENS


class Output(Protocol):
    """How one endpoint answers a generate request from its choice events."""

    @property
    def keep_text(self) -> bool:
        """Whether each choice keeps its whole text (a unary answer needs it)."""
        ...

    def head(self) -> bytes:
        """What a stream starts with, once the first events arrived (b"" for nothing)."""
        ...

    def chunks(self, batch: list[Event]) -> bytes:
        """One batch of events as stream bytes (b"" for nothing); the hot path."""
        ...

    def tail(self) -> bytes:
        """What ends a stream, once every event arrived."""
        ...

    def failed(self, exc: ServingError) -> bytes | None:
        """The stream bytes of an error after the stream started, or None to let it go up
        (the app writes it as one SSE error event)."""
        ...

    def body(self) -> bytes:
        """The unary answer, once every event arrived."""
        ...


class StreamFailed(ServingError):
    """The error was written into the event stream; nothing more to send."""

    def __init__(self, cause: ServingError) -> None:
        super().__init__(cause.message, param=cause.param)


def server_span(
    http: HttpRequest, request_id: str, model: str
) -> AbstractContextManager[Span | None]:
    """The request's root span (a child of the client's `traceparent`)."""
    return tracing.span(
        f"{http.method} {http.path}",
        parent=http.headers.get("traceparent"),
        kind=tracing.SERVER,
        request_id=request_id,
        model=model,
    )


class GeneratePipeline:
    """One frontend's generate path; safe for concurrent requests on one event loop."""

    def __init__(
        self,
        *,
        streamer: Streamer,
        metrics: FrontendMetrics,
        admission: Admission,
        images: ImageLoader,
        request_timeout_s: float,
    ) -> None:
        self.streamer, self.metrics, self.admission = streamer, metrics, admission
        self.images = images
        self.request_timeout_s = request_timeout_s

    def deadline_s(self) -> float:
        """The deadline (wall clock) of a request starting now, on the request plane."""
        return time.time() + self.request_timeout_s

    async def preprocess(
        self,
        http: HttpRequest,
        req: ChatCompletionRequest | CompletionRequest,
        model: ServedModel,
        request_id: str,
    ) -> Prepared:
        """`req`'s engine requests (the `preprocess` step)."""
        worker_id, deadline_s = http.headers.get(PIN_HEADER), self.deadline_s()
        if isinstance(req, ChatCompletionRequest):
            return await preprocess_chat(
                req,
                model,
                images=self.images,
                request_id=request_id,
                worker_id=worker_id,
                deadline_s=deadline_s,
            )
        return await preprocess_completion(
            req, model, request_id=request_id, worker_id=worker_id, deadline_s=deadline_s
        )

    async def run(
        self,
        response: HttpResponse,
        prepared: Prepared,
        states: list[ChoiceState],
        output: Output,
        *,
        stream: bool,
    ) -> None:
        """Route and stream `prepared` (`states[i]` processing `requests[i]`), answer through
        `output` (streamed or collected) and account the request in the metrics."""
        name = prepared.model.name
        self.metrics.arrived(name)
        timer = TokenTimer(self.metrics, name)
        failed = True
        try:
            events = engine_events(self.streamer, prepared, states, keep_text=output.keep_text)
            async with aclosing(events):
                if stream:
                    await stream_events(response, prepared, events, output, timer)
                else:
                    await collect_events(response, events, output, timer)
            failed = False
            self.metrics.finished(
                name,
                num_in=sum(prepared.prompt_lens),
                num_out=sum(s.num_tokens for s in states),
                num_cached=cached_tokens(prepared, states),
            )
        except StreamFailed:
            count_as(name, stream=True, failed=True)
        except (asyncio.CancelledError, ClientDisconnected):
            self.metrics.disconnects.labels(name).inc()
            raise
        finally:
            self.metrics.left(
                name,
                time.perf_counter() - timer.started,
                had_first_token=timer.last > 0.0,
                failed=failed,
            )


async def stream_events(
    response: HttpResponse,
    prepared: Prepared,
    events: Events,
    output: Output,
    timer: TokenTimer,
) -> None:
    """Write the events as they come: the headers once the first batch is in (errors before
    it get a real status), then one write per batch; raises StreamFailed for an error the
    output wrote into the stream."""
    batch = await anext(events, None)
    await response.start_stream()
    if head := output.head():
        await response.write(head)
    flush_first = flushes_first_token(prepared)
    try:
        while batch is not None:
            timer.tokens(len(batch))
            if data := output.chunks(batch):
                await response.write(data)
                if flush_first:  # a long prompt's first token leaves now, as its REQUEST did
                    response.flush()
                    flush_first = False
            batch = await anext(events, None)
    except ServingError as exc:
        events_of_error = output.failed(exc)
        if events_of_error is None:
            raise
        await response.write(events_of_error)
        await response.end_stream()
        raise StreamFailed(exc) from exc
    await response.write(output.tail())
    await response.end_stream()


async def collect_events(
    response: HttpResponse, events: Events, output: Output, timer: TokenTimer
) -> None:
    """Take every event, then send the output's body."""
    async for _ in events:
        if timer.last == 0.0:
            timer.token()  # unary: the first token only (no inter-token latency)
    await response.send(200, output.body())


def cached_tokens(prepared: Prepared, states: list[ChoiceState]) -> int:
    """Prompt tokens served from the prefix cache: each prompt's first choice reports them."""
    n = len(states) // max(len(prepared.prompt_lens), 1)
    return sum(states[p * n].num_cached_tokens or 0 for p in range(len(prepared.prompt_lens)))
