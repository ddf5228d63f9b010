"""The OpenAI HTTP app: routes requests to handlers, checks API keys, maps errors, counts
requests; the probes, metrics and model routes are its own.

The generate endpoints (`api.chat`, `api.responses`, `api.embeddings`) run on the generate
pipeline (`pipeline.generate`: admit → preprocess → route and stream → stream or collect →
account), which the app builds from its wiring.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Awaitable, Callable

import msgspec

from tandem import __version__
from tandem.errors import InvalidRequest, RateLimited, ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.adapters import LoraAdapters
from tandem.frontend.api import lora_routes, model_routes
from tandem.frontend.api.chat import ChatEndpoints
from tandem.frontend.api.embedder import Embedder
from tandem.frontend.api.embeddings import EmbeddingsEndpoint
from tandem.frontend.api.generate_tokens import GenerateTokensEndpoint
from tandem.frontend.api.messages import PATHS as MESSAGES_PATHS
from tandem.frontend.api.messages import MessagesEndpoint
from tandem.frontend.api.openapi import build_openapi
from tandem.frontend.api.render import RenderEndpoints
from tandem.frontend.api.request_input import client_request_id
from tandem.frontend.api.rerank import RERANK_PATHS, SCORE_PATHS, ScoreEndpoints
from tandem.frontend.api.responses.endpoint import ResponsesEndpoint
from tandem.frontend.auth import ApiKeys
from tandem.frontend.http.message import ClientDisconnected, HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.health import HealthMonitor
from tandem.frontend.observability.metrics import FrontendMetrics, close_tally, open_tally
from tandem.frontend.observability.worker_scrape import WorkerScraper
from tandem.frontend.pipeline.generate import Admission, GeneratePipeline
from tandem.frontend.pipeline.streamer import Streamer
from tandem.frontend.rate_limit import RateLimiter, ratelimit_headers
from tandem.frontend.tenancy import IDENTITY_HEADERS, Tenancy, current_identity
from tandem.multimodal.config import ImageConfig
from tandem.multimodal.loader import ImageLoader
from tandem.runtime.base import RequestClient
from tandem.runtime.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_MODEL_PREFIX = "/v1/models/"
# the `endpoint` label of tandem_frontend_requests_total; probes, scrapes and pages are not counted
API_ENDPOINTS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/inference/v1/generate": "generate_tokens",
    "/v1/completions/render": "completions_render",
    "/v1/chat/completions/render": "chat_completions_render",
    "/v1/models": "models",
    "/v1/route/explain": "route_explain",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    lora_routes.LOAD_PATH: "load_lora_adapter",
    lora_routes.UNLOAD_PATH: "unload_lora_adapter",
    **dict.fromkeys(RERANK_PATHS, "rerank"),
    **dict.fromkeys(SCORE_PATHS, "score"),
}
# the endpoints a tenant's requests/min limit counts (issue 33): those that run a model
LIMITED_ENDPOINTS = frozenset(
    {"chat_completions", "completions", "generate_tokens", "embeddings", "responses",
     "messages", "rerank", "score"}
)  # fmt: skip
Handler = Callable[[HttpRequest, HttpResponse], Awaitable[None]]
WORKER_METRICS = "/metrics/workers/"  # + a worker id: that worker's metrics alone
CLIENT_CLOSED = 499  # the status_code label of a request whose client went away (nginx's)


class FrontendApp:
    """The request handler given to HttpServer. One per frontend; one event loop."""

    def __init__(
        self,
        *,
        registry: ModelRegistry,
        streamer: Streamer,
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
        tenancy: Tenancy | None = None,
        limiter: RateLimiter | None = None,
        adapters: LoraAdapters | None = None,
    ) -> None:
        self.registry, self.metrics = registry, metrics
        self.workers = workers
        metrics.watch(registry)
        self.images = images or ImageLoader(ImageConfig())
        self.health_monitor = health
        self.tenancy, self.limiter = tenancy, limiter
        # who is asking, also without a tenants file: a request that sends an identity header
        # gets its class, deadline and session from it (never silently ignored); one that
        # sends none is the default tenant's, and nothing is resolved for it
        self._identities = tenancy or Tenancy()
        if tenancy is not None:  # tokens and limit hits per tenant in /metrics
            metrics.registry.register(tenancy.stats)
        self._auth = ApiKeys(
            api_keys, admin_api_keys, is_tenant_key=tenancy.has_key if tenancy else None
        )
        self.admission = Admission(
            max_inflight=max_inflight_requests,
            max_fanout=max_fanout,
            retry_after_s=retry_after_s,
        )
        self.pipeline = GeneratePipeline(
            streamer=streamer,
            metrics=metrics,
            admission=self.admission,
            images=self.images,
            request_timeout_s=request_timeout_s,
            tenancy=tenancy,
            limiter=limiter,
        )
        chat = ChatEndpoints(registry, self.pipeline)
        render = RenderEndpoints(registry, self.pipeline)
        # its store holds `previous_response_id`s
        self.responses = ResponsesEndpoint(registry, self.pipeline)
        messages = MessagesEndpoint(registry, self.pipeline)
        embedder = Embedder(self.pipeline, client)  # embeddings, rerank and score
        scores = ScoreEndpoints(registry, embedder)
        self._routes: dict[tuple[str, str], Callable[[HttpRequest, HttpResponse], Awaitable[None]]]
        self._routes = {
            ("POST", "/v1/chat/completions"): chat.chat_completions,
            ("POST", "/v1/completions"): chat.completions,
            ("POST", "/inference/v1/generate"): GenerateTokensEndpoint(registry, self.pipeline),
            ("POST", "/v1/completions/render"): render.completions,
            ("POST", "/v1/chat/completions/render"): render.chat_completions,
            ("GET", "/v1/models"): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/live"): self.live,
            ("GET", "/metrics"): self.prometheus,
            ("POST", "/v1/route/explain"): chat.route_explain,
            ("POST", "/v1/embeddings"): EmbeddingsEndpoint(registry, embedder),
            ("POST", "/v1/responses"): self.responses.create,
            ("GET", "/v1/models/{model}"): self.get_model,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/openapi.json"): self.openapi,
            ("POST", "/v1/messages"): messages.create,
            ("POST", "/v1/messages/count_tokens"): messages.count_tokens,
            **{("POST", path): scores.rerank for path in RERANK_PATHS},
            **{("POST", path): scores.score for path in SCORE_PATHS},
        }
        if workers is not None:
            self._routes[("GET", "/metrics/workers")] = self.worker_metrics
        if adapters is not None:  # LoRA adapters at run time (frontend/adapters.py)
            loras = lora_routes.LoraRoutes(adapters)
            self._routes[("POST", lora_routes.LOAD_PATH)] = loras.load
            self._routes[("POST", lora_routes.UNLOAD_PATH)] = loras.unload
        self._openapi: bytes | None = None
        # routes with an id in the path (`method, path -> handler or None`), after the table
        self.prefix_routes: list[Callable[[str, str], Handler | None]] = [self.responses.route]

    def add_route(
        self,
        method: str,
        path: str,
        handler: Callable[[HttpRequest, HttpResponse], Awaitable[None]],
    ) -> None:
        """Serve `handler` at `method path` too (behind the same API-key check)."""
        self._routes[(method, path)] = handler
        self._openapi = None  # /openapi.json lists it from now on

    def handler_for(self, method: str, path: str) -> Handler | None:
        """The handler the route table has for `method path` (an in-process caller, such as
        the batch runner, runs it without the HTTP edge's key check)."""
        return self._routes.get((method, path))

    def _prefix_route(self, method: str, path: str) -> Handler | None:
        for route in self.prefix_routes:
            if (handler := route(method, path)) is not None:
                return handler
        return None

    async def __call__(self, request: HttpRequest, response: HttpResponse) -> None:
        method = "GET" if request.method == "HEAD" else request.method  # HEAD works like GET
        handler = self._routes.get((method, _route_path(request.path))) or self._prefix_route(
            method, request.path
        )
        if handler is None and method == "GET" and request.path.startswith(WORKER_METRICS):
            handler = self._routes.get(("GET", WORKER_METRICS.rstrip("/")))
        endpoint = API_ENDPOINTS.get(request.path, "other" if handler is None else None)
        tally, token = open_tally()
        identity_token = None
        try:
            if (client_id := client_request_id(request.headers)) is not None:
                response.extra_headers.append(("x-request-id", client_id))
            if handler is None:
                raise _not_found(request, {_route_path(path) for _, path in self._routes})
            checked = self._auth.checked_paths
            if checked is None or request.path in checked:
                self._auth.check(request)
            if self.tenancy is not None or not IDENTITY_HEADERS.isdisjoint(request.headers):
                identity = self._identities.resolve(request)
                identity_token = current_identity.set(identity)
                if self.tenancy is not None and endpoint in LIMITED_ENDPOINTS:
                    self._limit_requests(identity.tenant, response)
            await handler(request, response)
        except ServingError as exc:
            tally.status = "error"
            anthropic = request.path in MESSAGES_PATHS
            if not response.started:
                status = http_errors.anthropic_status if anthropic else http_errors.error_status
                tally.status_code = status(exc)
            await self._send_error(response, exc, anthropic=anthropic)
        except (asyncio.CancelledError, ClientDisconnected):
            tally.status, tally.status_code = "cancelled", CLIENT_CLOSED
            raise
        except Exception:
            tally.status = "error"
            if not response.started:
                tally.status_code = 500  # the server answers 500 for what escapes here
            raise
        finally:
            if identity_token is not None:
                current_identity.reset(identity_token)
            close_tally(token)
            if endpoint is not None:
                self.metrics.counted(
                    tally.model, endpoint, tally.request_type, tally.status, tally.status_code
                )

    def _limit_requests(self, tenant: str, response: HttpResponse) -> None:
        """Take one from `tenant`'s requests/min bucket (RateLimited when empty)."""
        assert self.tenancy is not None
        limit = self.tenancy.table.get(tenant).requests_per_minute
        if self.limiter is None or limit is None:
            return
        try:
            states = self.limiter.take(tenant, {"requests": (limit, 1.0)})
        except RateLimited:
            self.tenancy.stats.limited[(tenant, "requests")] += 1
            raise
        response.extra_headers.extend(ratelimit_headers(states))

    async def _send_error(
        self, response: HttpResponse, exc: ServingError, *, anthropic: bool = False
    ) -> None:
        if anthropic:  # the Messages API's own error shape and statuses (529: overloaded)
            await _send_anthropic_error(response, exc)
            return
        body = http_errors.error_body(exc)
        if not response.started:
            status = http_errors.error_status(exc)
            await response.send(status, body, headers=http_errors.error_headers(exc))
        else:  # mid-stream: one SSE error event, then the end marker
            await response.write(b"data: " + body + b"\n\ndata: [DONE]\n\n")

    # ------------------------------------------------------------------ simple endpoints
    async def list_models(self, request: HttpRequest, response: HttpResponse) -> None:
        """The served models, then their LoRA adapters (vLLM's shape: `parent` the base
        model, `root` the adapter's directory)."""
        data = [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "tandem"}
            for m in self.registry.live()
        ]
        data += [model_routes.adapter_entry(card) for card in self.registry.live_adapters()]
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


async def _send_anthropic_error(response: HttpResponse, exc: ServingError) -> None:
    request_id = dict(response.extra_headers).get("request-id")
    body = _json.encode(http_errors.anthropic_error(exc, request_id))
    if not response.started:
        status = http_errors.anthropic_status(exc)
        await response.send(status, body, headers=http_errors.error_headers(exc))
    else:  # mid-stream: Anthropic's error event
        await response.write(b"event: error\ndata: " + body + b"\n\n")


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
