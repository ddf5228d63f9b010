"""The OpenAI HTTP app: routes requests to handlers, maps errors, tracks admission.

Flow per generate request (DESIGN.md §3): decode + validate → preprocess → route and stream
over the request plane (with migration) → postprocess per choice → SSE or one JSON body.
Headers are written only after the first engine output arrives, so routing failures still
get a proper status code (503 + Retry-After) instead of a broken stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec

from tandem import __version__
from tandem.errors import InvalidRequest, Overloaded, ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.api import model_routes
from tandem.frontend.api.completion_format import (
    ResponseFormat,
    cached_tokens,
    flushes_first_token,
    usage,
)
from tandem.frontend.api.embeddings import EmbeddingsEndpoint
from tandem.frontend.api.model_routes import client_request_id
from tandem.frontend.api.openapi import build_openapi
from tandem.frontend.api.request_body import completion_decoder, decode_body, decode_completion
from tandem.frontend.api.responses.endpoint import ResponsesEndpoint
from tandem.frontend.auth import ApiKeys
from tandem.frontend.http.server import ClientDisconnected, HttpRequest, HttpResponse
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.models import ModelRegistry, ServedModel
from tandem.frontend.observability.health import HealthMonitor
from tandem.frontend.observability.metrics import FrontendMetrics, TokenTimer
from tandem.frontend.observability.worker_scrape import WorkerScraper
from tandem.frontend.pipeline.choice_events import Events, engine_events
from tandem.frontend.pipeline.postprocess import ChoiceState, best_candidates
from tandem.frontend.pipeline.preprocess import Prepared, preprocess_chat, preprocess_completion
from tandem.frontend.pipeline.tool_parser import HermesToolParser, make_tool_parser
from tandem.multimodal.config import ImageConfig
from tandem.multimodal.loader import ImageLoader
from tandem.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    fan_out,
    num_candidates,
)
from tandem.runtime import tracing
from tandem.runtime.base import RequestClient
from tandem.runtime.log_format import request_scope
from tandem.runtime.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_json = msgspec.json.Encoder()
PIN_HEADER = "x-worker-instance-id"
_MODEL_PREFIX = "/v1/models/"
# the `endpoint` label of tandem_frontend_requests_total; probes, scrapes and pages are not counted
API_ENDPOINTS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/v1/route/explain": "route_explain",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
WORKER_METRICS = "/metrics/workers/"  # + a worker id: that worker's metrics alone
CLIENT_CLOSED = 499  # the status_code label of a request whose client went away (nginx's)


@dataclass(slots=True)
class _Tally:
    """What tandem_frontend_requests_total learns of one request while it runs: the model
    label only once the model is known to be served (no label per mistyped name)."""

    model: str = ""
    request_type: str = "unary"
    status: str = "success"
    status_code: int = 200


_tally: ContextVar[_Tally] = ContextVar("tandem_frontend_tally")


class FrontendApp:
    """The request handler given to HttpServer. One per frontend; one event loop."""

    def __init__(
        self,
        *,
        registry: ModelRegistry,
        streamer: EngineStreamer,
        metrics: FrontendMetrics,
        max_inflight_requests: int = 1024,
        max_fanout: int = 128,
        request_timeout_s: float = 600.0,
        retry_after_s: float = 1.0,
        images: ImageLoader | None = None,
        health: HealthMonitor | None = None,
        api_keys: tuple[str, ...] = (),
        admin_api_keys: tuple[str, ...] = (),
        workers: WorkerScraper | None = None,
        client: RequestClient | None = None,
    ) -> None:
        self.registry, self.streamer, self.metrics = registry, streamer, metrics
        self.workers = workers
        metrics.watch(registry)
        self.images = images or ImageLoader(ImageConfig())
        self.health_monitor = health
        self._auth = ApiKeys(api_keys, admin_api_keys)
        self._max_inflight = max_inflight_requests
        self._max_fanout = max_fanout
        self._timeout_s = request_timeout_s
        self._retry_after_s = retry_after_s
        self.num_inflight = 0  # engine requests admitted (a request counts its fan-out)
        self.responses = ResponsesEndpoint(self)  # its store holds `previous_response_id`s
        self._routes: dict[tuple[str, str], Callable[[HttpRequest, HttpResponse], Awaitable[None]]]
        self._routes = {
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("GET", "/v1/models"): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/live"): self.live,
            ("GET", "/metrics"): self.prometheus,
            ("POST", "/v1/route/explain"): self.route_explain,
            ("POST", "/v1/embeddings"): EmbeddingsEndpoint(self, client),
            ("POST", "/v1/responses"): self.responses.create,
            ("GET", "/v1/models/{model}"): self.get_model,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/openapi.json"): self.openapi,
        }
        if workers is not None:
            self._routes[("GET", "/metrics/workers")] = self.worker_metrics
        self._client_request_ids: set[str] = set()  # X-Request-IDs of requests in flight
        self._openapi: bytes | None = None

    def add_route(
        self,
        method: str,
        path: str,
        handler: Callable[[HttpRequest, HttpResponse], Awaitable[None]],
    ) -> None:
        """Serve `handler` at `method path` too (behind the same API-key check)."""
        self._routes[(method, path)] = handler
        self._openapi = None  # /openapi.json lists it from now on

    async def __call__(self, request: HttpRequest, response: HttpResponse) -> None:
        method = "GET" if request.method == "HEAD" else request.method  # HEAD works like GET
        handler = self._routes.get((method, _route_path(request.path))) or self.responses.route(
            method, request.path
        )
        if handler is None and method == "GET" and request.path.startswith(WORKER_METRICS):
            handler = self._routes.get(("GET", WORKER_METRICS.rstrip("/")))
        endpoint = API_ENDPOINTS.get(request.path, "other" if handler is None else None)
        tally = _Tally()
        token = _tally.set(tally)
        try:
            if (client_id := client_request_id(request.headers)) is not None:
                response.extra_headers.append(("x-request-id", client_id))
            if handler is None:
                raise _not_found(request, {_route_path(path) for _, path in self._routes})
            self._auth.check(request)
            await handler(request, response)
        except ServingError as exc:
            tally.status = "error"
            if not response.started:
                tally.status_code = http_errors.error_status(exc)
            await self._send_error(response, exc)
        except (asyncio.CancelledError, ClientDisconnected):
            tally.status, tally.status_code = "cancelled", CLIENT_CLOSED
            raise
        except Exception:
            tally.status = "error"
            if not response.started:
                tally.status_code = 500  # the server answers 500 for what escapes here
            raise
        finally:
            _tally.reset(token)
            if endpoint is not None:
                self.metrics.counted(
                    tally.model, endpoint, tally.request_type, tally.status, tally.status_code
                )

    def count_as(self, model: str, *, stream: bool, failed: bool = False) -> None:
        """Label the running request's tandem_frontend_requests_total sample (for handlers in
        other modules: /v1/embeddings, /v1/responses); `failed` for an error already written
        into a started stream."""
        tally = _tally.get(None)
        if tally is not None:
            tally.model, tally.request_type = model, "stream" if stream else "unary"
            if failed:
                tally.status = "error"

    async def _send_error(self, response: HttpResponse, exc: ServingError) -> None:
        body = http_errors.error_body(exc)
        if not response.started:
            status = http_errors.error_status(exc)
            await response.send(status, body, headers=http_errors.error_headers(exc))
        else:  # mid-stream: one SSE error event, then the end marker
            await response.write(b"data: " + body + b"\n\ndata: [DONE]\n\n")

    # ------------------------------------------------------------------ simple endpoints
    async def list_models(self, request: HttpRequest, response: HttpResponse) -> None:
        data = [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "tandem"}
            for m in self.registry.live()
        ]
        await response.send(200, _json.encode({"object": "list", "data": data}))

    async def get_model(self, request: HttpRequest, response: HttpResponse) -> None:
        """GET /v1/models/{model}: one served model (ids may contain '/'); 404 otherwise."""
        name = urllib.parse.unquote(request.path.removeprefix(_MODEL_PREFIX))
        await response.send(200, model_routes.served_model(self.registry, name))

    async def tokenize(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, await model_routes.tokenize(self.registry, request.body))

    async def detokenize(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, await model_routes.detokenize(self.registry, request.body))

    async def openapi(self, request: HttpRequest, response: HttpResponse) -> None:
        """GET /openapi.json: generated from the route table and the request/response types."""
        if self._openapi is None:
            self._openapi = _json.encode(build_openapi(self._routes, __version__))
        await response.send(200, self._openapi)

    async def health(self, request: HttpRequest, response: HttpResponse) -> None:
        """200 when every served model can serve now; else 503 naming what is missing."""
        if self.health_monitor is not None:
            healthy, body = self.health_monitor.health()
        else:  # no monitor (embedded use): instances only
            models = {m.name: sorted(m.instances.instances) for m in self.registry.models.values()}
            healthy = any(models.values())
            body = {"status": "healthy" if healthy else "no_workers", "instances": models}
        await response.send(200 if healthy else 503, _json.encode(body))

    async def live(self, request: HttpRequest, response: HttpResponse) -> None:
        """The process and its event loop answer (this reply is the proof)."""
        if self.health_monitor is None:
            await response.send(200, b'{"status":"live"}')
            return
        live, body = self.health_monitor.live()
        await response.send(200 if live else 503, _json.encode(body))

    async def prometheus(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, self.metrics.render(), content_type=CONTENT_TYPE)

    async def worker_metrics(self, request: HttpRequest, response: HttpResponse) -> None:
        """Every worker's metrics, merged (`/metrics/workers`), or one worker's
        (`/metrics/workers/{worker_id}`), fetched over the request plane."""
        assert self.workers is not None  # the route exists only with a scraper
        worker_id = (
            request.path.removeprefix(WORKER_METRICS)
            if request.path.startswith(WORKER_METRICS)
            else None
        )
        text = await self.workers.scrape(worker_id or None)
        await response.send(200, text, content_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ generate endpoints
    async def chat_completions(self, request: HttpRequest, response: HttpResponse) -> None:
        req = decode_body(_chat_decoder, request.body)
        await self._generate(request, response, req, ResponseFormat(chat=True))

    async def completions(self, request: HttpRequest, response: HttpResponse) -> None:
        req = decode_completion(request.body)
        await self._generate(request, response, req, ResponseFormat(chat=False))

    async def _generate(
        self,
        http: HttpRequest,
        response: HttpResponse,
        req: ChatCompletionRequest | CompletionRequest,
        fmt: ResponseFormat,
    ) -> None:
        model = self.registry.get(req.model)
        tally = _tally.get(None)  # None when a handler is called without __call__
        if tally is not None:
            tally.model, tally.request_type = model.name, "stream" if req.stream else "unary"
        model.require_task("generate", "/v1/chat/completions" if fmt.chat else "/v1/completions")
        client_id = client_request_id(http.headers)
        if client_id is not None and client_id in self._client_request_ids:
            raise InvalidRequest(
                f"X-Request-ID={client_id!r} is already in flight; expected a unique id",
                param="X-Request-ID",
            )
        num_slots = self._admit(req)
        if client_id is not None:
            self._client_request_ids.add(client_id)
        request_id = (
            f"{'chatcmpl' if fmt.chat else 'cmpl'}-{client_id or model_routes.new_request_id()}"
        )
        try:
            with (
                request_scope(request_id),
                tracing.span(
                    f"POST {http.path}",
                    parent=http.headers.get("traceparent"),
                    kind=tracing.SERVER,
                    request_id=request_id,
                    model=model.name,
                ),
            ):
                logger.debug("request_id=%s %s model=%s", request_id, http.path, model.name)
                await model.ready()
                with tracing.span("preprocess"):
                    prepared = await self._preprocess(http, req, model, request_id)
                if req.user is not None or req.safety_identifier is not None:
                    logger.debug(
                        "request_id=%s user=%s safety_identifier=%s",
                        request_id,
                        req.user,
                        req.safety_identifier,
                    )
                fmt.bind(request_id, model.name)
                await self._run_tracked(response, req, prepared, fmt)
        finally:
            self.num_inflight -= num_slots
            if client_id is not None:
                self._client_request_ids.discard(client_id)

    def _admit(self, req: ChatCompletionRequest | CompletionRequest) -> int:
        """Take one in-flight slot per engine request `req` fans out to (prompts × n) and
        return how many; the caller releases them. Raises InvalidRequest past the per-request
        cap, Overloaded (503 + Retry-After) when the slots are not free. Slots are taken
        before any await, so concurrent arrivals cannot overshoot the bound while they
        preprocess."""
        num = fan_out(req)
        cap = min(self._max_fanout, self._max_inflight)
        if num > cap:
            per_prompt = num_candidates(req)
            what = f"best_of={per_prompt}" if req.best_of is not None else f"n={req.n}"
            prompts = "1 prompt" if num == per_prompt else f"{num // per_prompt} prompts"
            raise InvalidRequest(
                f"request fans out to {num} engine requests ({prompts} × {what}); "
                f"at most {cap} per request (--max-fanout {self._max_fanout}, "
                f"--max-inflight-requests {self._max_inflight}); split it or lower n",
                param=what.split("=")[0] if num == per_prompt else "prompt",
            )
        if self.num_inflight + num > self._max_inflight:
            raise Overloaded(
                f"{self.num_inflight} engine requests in flight + {num} asked exceeds the limit "
                f"{self._max_inflight}; retry later",
                retry_after_s=self._retry_after_s,
            )
        self.num_inflight += num
        return num

    async def _preprocess(
        self,
        http: HttpRequest,
        req: ChatCompletionRequest | CompletionRequest,
        model: ServedModel,
        request_id: str,
    ) -> Prepared:
        kwargs: dict[str, Any] = {
            "request_id": request_id,
            "worker_id": http.headers.get(PIN_HEADER),
            "deadline_s": time.time() + self._timeout_s,
        }
        if isinstance(req, ChatCompletionRequest):
            return await preprocess_chat(req, model, images=self.images, **kwargs)
        return await preprocess_completion(req, model, **kwargs)

    async def route_explain(self, request: HttpRequest, response: HttpResponse) -> None:
        """`POST /v1/route/explain` with a chat (has `messages`) or completions body: the
        router's `explain` of its first engine request (a remote router's service answers
        through `explain_remote`), routing nothing. 404 when the policy cannot explain."""
        try:
            is_chat = "messages" in msgspec.json.decode(request.body)
        except (*http_errors.BODY_ERRORS, TypeError):
            is_chat = False  # the completions decoder below names what is wrong
        req = decode_body(_chat_decoder if is_chat else completion_decoder, request.body)
        model = self.registry.get(req.model)
        await model.ready()
        prepared = await self._preprocess(request, req, model, f"explain-{uuid.uuid4().hex}")
        remote = getattr(model.router, "explain_remote", None)
        explain = getattr(model.router, "explain", None)
        try:
            if remote is not None:
                result = await remote(prepared.requests[0])
            elif explain is not None:
                result = explain(prepared.requests[0])
            else:
                raise NotImplementedError
        except NotImplementedError:
            err = InvalidRequest(f"the router of model '{model.name}' cannot explain its choice")
            err.status_code = 404
            raise err from None
        await response.send(200, _json.encode(result))

    async def _run_tracked(
        self, response: HttpResponse, req: Any, prepared: Prepared, fmt: ResponseFormat
    ) -> None:
        name = prepared.model.name
        self.metrics.arrived(name)
        timer = TokenTimer(self.metrics, name)
        failed = True
        try:
            states = [
                ChoiceState(
                    i,
                    prepared.model.tokenizer,
                    prepared.stop_strings,
                    include_stop_str=prepared.include_stop_str,
                    skip_special_tokens=prepared.skip_special_tokens,
                )
                for i in range(len(prepared.requests))
            ]
            if prepared.echo_texts is not None:  # choices of prompt p: p*k .. p*k+k-1
                per_prompt = len(states) // len(prepared.echo_texts)
                for state in states:
                    state.prefix = prepared.echo_texts[state.index // per_prompt]
            events = engine_events(self.streamer, prepared, states, keep_text=not req.stream)
            parsers = _tool_parsers(prepared)
            async with aclosing(events):
                if req.stream:
                    await self._stream(response, req, prepared, states, events, fmt, timer, parsers)
                else:
                    await self._collect(response, prepared, states, events, fmt, timer, parsers)
            failed = False
            self.metrics.finished(
                name,
                num_in=sum(prepared.prompt_lens),
                num_out=sum(s.num_tokens for s in states),
                num_cached=cached_tokens(prepared, states),
            )
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

    async def _stream(
        self,
        response: HttpResponse,
        req: Any,
        prepared: Prepared,
        states: list[ChoiceState],
        events: Events,
        fmt: ResponseFormat,
        timer: TokenTimer,
        parsers: list[HermesToolParser] | None = None,
    ) -> None:
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats
        batch = await anext(events, None)  # errors before this point get a real status
        await response.start_stream()
        if fmt.chat:
            await response.write(b"".join(fmt.role_chunk(s.index) for s in states))
        flush_first = flushes_first_token(prepared)
        while batch is not None:
            timer.tokens(len(batch))
            chunks = []  # one SSE chunk per engine chunk; a batch's leave in one write
            for state, text, logprobs, finish, num_tokens in batch:
                calls = None
                if parsers is not None:  # tool-call markup becomes delta.tool_calls
                    parser = parsers[state.index]
                    text, calls = parser.feed(text, final=finish is not None)
                    finish = "tool_calls" if finish == "stop" and parser.calls else finish
                if text or finish is not None or logprobs or calls:
                    running = None
                    if continuous:
                        running = usage(prepared, states, at=(state, num_tokens))
                    chunks.append(fmt.chunk(state.index, text, logprobs, finish, running, calls))
            if chunks:
                await response.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))
                if flush_first:  # a long prompt's first token leaves now, as its REQUEST did
                    response.flush()
                    flush_first = False
            batch = await anext(events, None)
        if include_usage:
            await response.write(fmt.usage_chunk(usage(prepared, states)))
        await response.write(b"data: [DONE]\n\n")
        await response.end_stream()

    async def _collect(
        self,
        response: HttpResponse,
        prepared: Prepared,
        states: list[ChoiceState],
        events: Events,
        fmt: ResponseFormat,
        timer: TokenTimer,
        parsers: list[HermesToolParser] | None = None,
    ) -> None:
        async for _ in events:
            if timer.last == 0.0:
                timer.token()  # unary: the first token only (no inter-token latency)
        choices = states
        if prepared.best_of is not None:  # usage still counts every candidate (as OpenAI bills)
            keep = prepared.num_top_logprobs is not None
            position = {id(s): i for i, s in enumerate(states)}
            choices = best_candidates(states, prepared.best_of, prepared.n, keep_logprobs=keep)
            if parsers is not None:  # each chosen candidate keeps its own parser
                parsers = [parsers[position[id(s)]] for s in choices]
        body = fmt.full_response(choices, usage(prepared, states), parsers)
        await response.send(200, body)


def _route_path(path: str) -> str:
    """The route table's key for `path`: model ids fill `/v1/models/{model}`."""
    if path.startswith(_MODEL_PREFIX) and len(path) > len(_MODEL_PREFIX):
        return "/v1/models/{model}"
    return path


def _not_found(request: HttpRequest, paths: set[str]) -> ServingError:
    if request.path in paths:
        err = InvalidRequest(f"method {request.method} not allowed on {request.path}")
        err.status_code = 405
        return err
    err = InvalidRequest(f"no route {request.method} {request.path}; try /v1/chat/completions")
    err.status_code = 404
    return err


def _tool_parsers(prepared: Prepared) -> list[HermesToolParser] | None:
    """One tool-call parser per choice when the request offered tools."""
    if prepared.tool_parser is None:
        return None
    make = make_tool_parser
    return [
        make(prepared.tool_parser, max_calls=prepared.max_tool_calls) for _ in prepared.requests
    ]
