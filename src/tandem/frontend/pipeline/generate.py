"""The generate pipeline every generate endpoint runs: admit → preprocess → route and stream
→ stream or collect → account.

- admit: `Admission.slots(n)` holds one in-flight slot per engine request the request fans out
  to (prompts × n, or 1 for an embeddings call), taken before any await so concurrent arrivals
  cannot overshoot the bound while they preprocess (503 past it; every queue is bounded);
- preprocess: `preprocess(...)` turns a chat or completions request into engine requests
  (chat template, tokenization, limits, images);
- route and stream: `run(...)` opens the engine streams over the request plane, with
  migration (`Streamer`), and turns their outputs into batches of choice events
  (`engine_events`): each output is processed (detokenized, stop strings applied) into one
  `Event`, a batch being every output that had already arrived; a request of several choices
  (n > 1, several prompts, best_of) merges its choices' streams, batch by batch;
- stream or collect: the endpoint's `Output` encodes the events, as SSE chunks written as
  they come (headers only once the first output arrived, so routing failures still get a
  proper status code) or as one body once the last arrived;
- account: the frontend's metrics (arrivals, TTFT/ITL, tokens, disconnects, failures).

Chat and completions (`api.chat`) and `/v1/responses` (`api.responses`) differ only in their
`Output`; `/v1/embeddings` admits, routes and accounts its single call itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import AbstractContextManager, aclosing, contextmanager, nullcontext
from typing import Protocol

from tandem.errors import InvalidRequest, Overloaded, RateLimited, ServingError
from tandem.frontend.http.message import ClientDisconnected, HttpRequest, HttpResponse
from tandem.frontend.models import ServedModel
from tandem.frontend.observability.metrics import FrontendMetrics, TokenTimer, count_as
from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.pipeline.preprocess import Prepared, preprocess_chat, preprocess_completion
from tandem.frontend.pipeline.streamer import Streamer
from tandem.frontend.rate_limit import RateLimiter, ratelimit_headers
from tandem.frontend.tenancy import Tenancy, current_identity
from tandem.multimodal.loader import ImageLoader
from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    fan_out,
    num_candidates,
)
from tandem.protocols.tenancy import DEFAULT_IDENTITY, RequestIdentity, parse_priority
from tandem.runtime import log_format, tracing

Events = AsyncGenerator[list[Event], None]

PIN_HEADER = "x-worker-instance-id"  # a request pinned to one worker (tests, debugging)

# a stream of a prompt this long writes its first token at once rather than after every
# other callback of the loop iteration (its TTFT), as the request plane writes its REQUEST
# (runtime/tcp/frame.FLUSH_NOW_BYTES); a short one's rides the iteration's coalesced write
FLUSH_FIRST_TOKEN_PROMPT_TOKENS = 4096
_NO_SCOPE = nullcontext()  # shared: entering it does nothing


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


def request_context(http: HttpRequest, request_id: str, model: str) -> AbstractContextManager[None]:
    """What a request runs inside: its root span, a child of the client's `traceparent`
    (tracing on), and its id on its log lines (JSON logs); a shared no-op when neither is on
    (the default: a plain request enters neither module)."""
    if tracing.enabled:
        return _traced(http, request_id, model)
    if log_format.request_ids_logged:
        return log_format.request_scope(request_id)
    return _NO_SCOPE


@contextmanager
def _traced(http: HttpRequest, request_id: str, model: str) -> Iterator[None]:
    with (
        log_format.request_scope(request_id),
        tracing.span(
            f"{http.method} {http.path}",
            parent=http.headers.get("traceparent"),
            kind=tracing.SERVER,
            request_id=request_id,
            model=model,
        ),
    ):
        yield


def step_span(name: str) -> AbstractContextManager[object]:
    """A span around one step of the request (`preprocess`), a child of its root span;
    a shared no-op when tracing is off."""
    return tracing.span(name) if tracing.enabled else _NO_SCOPE


class Admission:
    """The in-flight slots of one frontend; one event loop."""

    def __init__(self, *, max_inflight: int, max_fanout: int, retry_after_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_fanout = max_fanout
        self.retry_after_s = retry_after_s
        self.num_inflight = 0  # engine requests admitted (a request counts its fan-out)

    def fan_out(self, req: ChatCompletionRequest | CompletionRequest) -> int:
        """How many engine requests `req` fans out to (prompts × n); raises InvalidRequest past
        the per-request cap."""
        num = fan_out(req)
        cap = min(self.max_fanout, self.max_inflight)
        if num > cap:
            per_prompt = num_candidates(req)
            what = f"best_of={per_prompt}" if req.best_of is not None else f"n={req.n}"
            prompts = "1 prompt" if num == per_prompt else f"{num // per_prompt} prompts"
            raise InvalidRequest(
                f"request fans out to {num} engine requests ({prompts} × {what}); "
                f"at most {cap} per request (--max-fanout {self.max_fanout}, "
                f"--max-inflight-requests {self.max_inflight}); split it or lower n",
                param=what.split("=")[0] if num == per_prompt else "prompt",
            )
        return num

    @contextmanager
    def slots(self, num: int) -> Iterator[None]:
        """Hold `num` slots for the block; raises Overloaded (503 + Retry-After) when they are
        not free."""
        if self.num_inflight + num > self.max_inflight:
            raise Overloaded(
                f"{self.num_inflight} engine requests in flight + {num} asked exceeds the limit "
                f"{self.max_inflight}; retry later",
                retry_after_s=self.retry_after_s,
            )
        self.num_inflight += num
        try:
            yield
        finally:
            self.num_inflight -= num


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
        tenancy: Tenancy | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.streamer, self.metrics, self.admission = streamer, metrics, admission
        self.images = images
        self.request_timeout_s = request_timeout_s
        # issue 33: who is asking (None: every request is the default tenant's, class
        # normal, FIFO) and the per-tenant limits (None: none configured)
        self.tenancy, self.limiter = tenancy, limiter

    def deadline_s(self) -> float:
        """The deadline (wall clock) of a request starting now, on the request plane."""
        return time.time() + self.request_timeout_s

    async def preprocess(
        self,
        http: HttpRequest,
        req: ChatCompletionRequest | CompletionRequest,
        model: ServedModel,
        request_id: str,
        *,
        identity: RequestIdentity | None = None,
    ) -> Prepared:
        """`req`'s engine requests (the `preprocess` step), stamped with `identity` (else
        the running request's, `tenancy.current_identity`, else the default tenant's):
        tenant, priority class (the body's `priority` wins, within the tenant's ceiling),
        deadline and session."""
        worker_id, deadline_s = http.headers.get(PIN_HEADER), self.deadline_s()
        if isinstance(req, ChatCompletionRequest):
            prepared = await preprocess_chat(
                req,
                model,
                images=self.images,
                request_id=request_id,
                worker_id=worker_id,
                deadline_s=deadline_s,
            )
        else:
            prepared = await preprocess_completion(
                req, model, request_id=request_id, worker_id=worker_id, deadline_s=deadline_s
            )
        self._stamp(prepared, identity or current_identity.get(DEFAULT_IDENTITY), req)
        self._isolate(prepared)
        return prepared

    def _isolate(self, prepared: Prepared) -> None:
        """An isolated tenant's requests carry a salt of their own (DESIGN §5), so its KV
        blocks are never shared with another tenant's, in the router's index, the engines'
        prefix caches or the KV tiers. It starts with a control character, which a client's
        `cache_salt` may not hold, and keeps the client's salt after it."""
        identity = prepared.identity
        if identity is None or self.tenancy is None:
            return
        if not self.tenancy.table.get(identity.tenant).isolated:
            return
        for request in prepared.requests:
            own = f"\x00tenant:{identity.tenant}"
            request.cache_salt = (
                own if request.cache_salt is None else f"{own}\x00{request.cache_salt}"
            )

    def _stamp(
        self,
        prepared: Prepared,
        identity: RequestIdentity,
        req: ChatCompletionRequest | CompletionRequest,
    ) -> None:
        session = identity.session_id
        if session is None and req.user and self.tenancy and self.tenancy.table.session_from_user:
            session = req.user
        for request in prepared.requests:
            request.session_id = session
        body_priority = req.priority
        priority = identity.priority
        if body_priority is not None:
            priority = parse_priority(body_priority, param="priority")
            if self.tenancy is not None:
                self.tenancy.check_ceiling(identity.tenant, priority, param="priority")
        for request in prepared.requests:
            request.priority, request.tenant = priority, identity.tenant
            if self.tenancy is not None:
                request.tenant_weight = self.tenancy.table.get(identity.tenant).weight
            if identity.deadline_s is not None:
                request.deadline_s = min(request.deadline_s or identity.deadline_s,
                                         identity.deadline_s)  # fmt: skip
        if priority != identity.priority:
            identity = dataclasses.replace(identity, priority=priority)
        prepared.identity = identity

    def charge_tokens(
        self, response: HttpResponse | None, prepared: Prepared, num_tokens: int, *, done: bool
    ) -> None:
        """Take `num_tokens` from the tenant's tokens/min bucket: prompt tokens before the
        request runs (RateLimited when short), generated ones when it ended (debt allowed)."""
        identity = prepared.identity
        if self.limiter is None or self.tenancy is None or identity is None:
            return
        limit = self.tenancy.table.get(identity.tenant).tokens_per_minute
        if limit is None or (done and num_tokens <= 0):
            return
        try:
            states = self.limiter.take(
                identity.tenant, {"tokens": (limit, float(num_tokens))}, allow_debt=done
            )
        except RateLimited:
            self.tenancy.stats.limited[(identity.tenant, "tokens")] += 1
            raise
        if response is not None and not response.started:
            response.extra_headers.extend(ratelimit_headers(states))

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
        self.charge_tokens(response, prepared, sum(prepared.prompt_lens), done=False)
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
            self.charge_tokens(None, prepared, sum(s.num_tokens for s in states), done=True)
            if timer.last > 0.0 or not failed:  # served: its prompt was computed
                self._count_tokens(prepared, "prompt", sum(prepared.prompt_lens))
            self._count_tokens(prepared, "output", sum(s.num_tokens for s in states))

    def _count_tokens(self, prepared: Prepared, kind: str, num_tokens: int) -> None:
        if self.tenancy is not None and prepared.identity is not None:
            self.tenancy.stats.tokens[(prepared.identity.tenant, kind)] += num_tokens


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


def choice_state(prepared: Prepared, index: int = 0) -> ChoiceState:
    """The state that turns the outputs of `prepared`'s engine request `index` into text: its
    stop strings, whether special tokens are skipped and which ids are never text (a Mistral
    model's EOS where special tokens stay for a tool-call parser). Every endpoint builds its
    choices here, so none drops one of them."""
    return ChoiceState(
        index,
        prepared.model.tokenizer,
        prepared.stop_strings,
        include_stop_str=prepared.include_stop_str,
        skip_special_tokens=prepared.skip_special_tokens,
        hidden_token_ids=prepared.hidden_token_ids,
    )


def cached_tokens(prepared: Prepared, states: list[ChoiceState]) -> int:
    """Prompt tokens served from the prefix cache: each prompt's first choice reports them."""
    n = len(states) // max(len(prepared.prompt_lens), 1)
    return sum(states[p * n].num_cached_tokens or 0 for p in range(len(prepared.prompt_lens)))


def engine_events(
    streamer: Streamer, prepared: Prepared, states: list[ChoiceState], *, keep_text: bool
) -> Events:
    """The events of `prepared`'s engine requests, `states[i]` processing `requests[i]`;
    `keep_text` keeps each choice's whole text (unary answers)."""
    if len(states) == 1:
        return _choice_events(streamer, prepared, prepared.requests[0], states[0], keep_text)
    return _merged_events(streamer, prepared, states, keep_text)


async def _choice_events(
    streamer: Streamer,
    prepared: Prepared,
    request: PreprocessedRequest,
    state: ChoiceState,
    keep_text: bool,
) -> Events:
    """One choice's batches. An engine error comes after the events before it."""
    batches = streamer.stream_batches(request, prepared.model.router)
    async with aclosing(batches):
        async for outputs in batches:
            events: list[Event] = []
            error = None
            for out in outputs:
                try:
                    state.process(out, keep_text=keep_text)
                except Exception as exc:
                    error = exc
                    break
                finish = state.finish_reason
                events.append(
                    (state, state.delta_text, state.delta_logprobs, finish, state.num_tokens)
                )
                if finish is not None:
                    break
            if events:
                yield events
            if error is not None:
                raise error
            if state.finish_reason is not None:
                return  # closing `batches` cancels the worker (e.g. a stop string hit)


async def _merged_events(
    streamer: Streamer, prepared: Prepared, states: list[ChoiceState], keep_text: bool
) -> Events:
    queue: asyncio.Queue[list[Event] | BaseException | None] = asyncio.Queue(maxsize=256)

    async def pump(request: PreprocessedRequest, state: ChoiceState) -> None:
        try:
            async with aclosing(
                _choice_events(streamer, prepared, request, state, keep_text)
            ) as choice_events:
                async for batch in choice_events:
                    await queue.put(batch)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [
        asyncio.create_task(pump(r, s)) for r, s in zip(prepared.requests, states, strict=True)
    ]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
