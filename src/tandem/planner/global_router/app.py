"""The global router's HTTP proxy: OpenAI requests in, forwarded to the chosen pool's frontend.

Routes: every OpenAI route a frontend serves. The POST routes (`/v1/chat/completions`,
`/v1/completions`, `/v1/responses`, `/v1/embeddings`, `/tokenize`, `/detokenize`) go to the
pool the grids choose; a `/v1/responses` request that continues a stored response
(`previous_response_id`) goes to the frontend that stores it, since a frontend keeps its
responses in its own memory. `GET /v1/models` merges the pools' lists; `GET /v1/models/{id}`
and `GET`/`DELETE /v1/responses/{id}` ask the frontends fastest first and answer with the
first that knows the id (404 when none does). `/health` (200 while a frontend is healthy) and
`/live` are the router's own and always open; with `api_keys` every other route needs
`Authorization: Bearer <key>` (checked here, then forwarded for the pool to check too).

Headers: the client's end-to-end request headers reach the pool (Authorization,
X-Request-ID, traceparent, ...); hop-by-hop ones are dropped (RFC 9110 §7.6.1: Connection
and the headers it names, Keep-Alive, Proxy-Connection, TE, Trailer, Transfer-Encoding,
Upgrade), and Host, Content-Length and Accept-Encoding are the router's own. Back to the
client go the pool's status, Content-Type, X-Request-ID, WWW-Authenticate (401) and
Retry-After (429, 503), plus `x-tandem-pool`.

The response is streamed back as it arrives. Before the first byte reaches the client, a pool
that fails (connection refused, 429 or 5xx: no workers, overloaded) hands the request to the
next faster pool (a prefill-first pair: the next pool with a frontend listed before its
prefill pool); after it, the client sees the pool's stream and its errors as they are. When
every candidate answered with such an error, the last answer is relayed as it was (its 429
and Retry-After included); when none answered at all, 503.

Namespaces: each pool names the namespace its frontend serves. Before the first request to a
frontend, the router reads its `/health` and refuses to send there while the frontend reports
another namespace (the url points at the wrong pool); the refusal counts as that pool failing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict, CIMultiDictProxy

from tandem.errors import InvalidRequest, ServingError
from tandem.frontend.auth import ApiKeys
from tandem.planner.global_router.config import GlobalRouterConfig
from tandem.planner.global_router.decision import Decision, decide, targets_from
from tandem.tokens.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)
RETRYABLE = {429, 500, 502, 503, 504}
CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 5.0  # /health and lookup requests to a pool
POST_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)
# RFC 9110 §7.6.1 hop-by-hop fields (plus the ones the Connection field names), and the fields
# the router sets itself for its own connection to the pool
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade"}
)  # fmt: skip
OWN_FIELDS = frozenset({"host", "content-length", "accept-encoding"})
Answer = tuple[int, bytes, list[tuple[str, str]]]  # a pool's status, body and returned fields


def forwarded_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """The client's end-to-end request fields, every value kept, hop-by-hop ones dropped."""
    named = {
        token.strip().lower()
        for value in headers.getall("connection", [])
        for token in value.split(",")
        if token.strip()
    }
    drop = HOP_BY_HOP | OWN_FIELDS | named
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def returned_headers(status: int, headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The pool's response fields that go back to the client."""
    names = ["content-type", "x-request-id"]
    if status == 401:
        names.append("www-authenticate")
    if status in (429, 503):
        names.append("retry-after")
    return [(name, v) for name in names for v in headers.getall(name, [])]


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status)


@dataclass(frozen=True, slots=True)
class Frontend:
    label: str  # a pool's name, or a pair's "prefill+decode"
    url: str
    namespace: str


@dataclass(slots=True)
class _Failed:
    """Why a candidate did not answer well; `status` etc. when it answered at all."""

    why: str
    pool: str = ""
    status: int = 0
    body: bytes = b""
    headers: list[tuple[str, str]] | None = None


class GlobalRouterApp:
    def __init__(
        self,
        config: GlobalRouterConfig,
        tokenizer: ModelTokenizer | None,
        *,
        api_keys: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.session: aiohttp.ClientSession | None = None
        self.num_routed: dict[str, int] = {}
        self._auth = ApiKeys(api_keys, ())
        self._namespace_ok: set[str] = set()  # frontend urls whose /health named their namespace
        self.frontends = self._frontends()

    def _frontends(self) -> list[Frontend]:
        """Every frontend the router can reach, fastest first (pools, then pairs), each once."""
        out: dict[str, Frontend] = {}
        for name in self.config.order:
            pool = self.config.pools[name]
            if pool.url:
                out.setdefault(pool.url, Frontend(name, pool.url, pool.namespace))
        for pair in self.config.raw.disaggregated:
            ns = self.config.pools[pair.prefill].namespace
            out.setdefault(pair.url, Frontend(f"{pair.prefill}+{pair.decode}", pair.url, ns))
        return list(out.values())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20, middlewares=[self._check_key])
        for path in POST_ROUTES:
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.lookup)
        app.router.add_get("/v1/responses/{id}", self.lookup)
        app.router.add_delete("/v1/responses/{id}", self.lookup)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.on_response_prepare.append(_echo_request_id)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            self._auth.check(request)  # type: ignore[arg-type]  # path, method, headers.get
        except ServingError as exc:
            response = _error(int(exc.status_code), exc.message, exc.error_type)
            if exc.status_code == 401:
                response.headers["www-authenticate"] = 'Bearer realm="tandem"'
            return response
        return await handler(request)

    async def _open(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        # auto_decompress: the client gets the body decoded, without the pool's encoding field
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=True)

    async def _close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ request size
    def count_isl(self, body: dict[str, Any]) -> int:
        """The prompt's tokens: `prompt` (completions), `messages` (chat) or `input`
        (responses, embeddings, as text, token ids or message items)."""
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        parts: list[str] = []
        if isinstance(prompt, str):
            parts.append(prompt)
        elif isinstance(prompt, list):
            for p in prompt:
                if isinstance(p, str):
                    parts.append(p)
                elif isinstance(p, dict):
                    parts += _texts(p.get("content"))
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                parts += _texts(m.get("content"))
        text = "\n".join(parts)
        if self.tokenizer is None:
            return max(len(text) // 4, 1)  # no tokenizer configured: ~4 characters a token
        return len(self.tokenizer.encode(text))

    # ------------------------------------------------------------------ POST routes
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise InvalidRequest("the request body must be a JSON object")
            targets = targets_from(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"invalid JSON body: {exc}")
        except InvalidRequest as exc:
            return _error(400, str(exc))
        payload = json.dumps(body).encode()
        headers = forwarded_headers(request.headers)
        headers["content-type"] = "application/json"
        previous = body.get("previous_response_id") if request.path == "/v1/responses" else None
        if isinstance(previous, str) and previous:
            return await self._continue_response(request, previous, payload, headers)
        max_tokens = _int(body.get("max_tokens") or body.get("max_completion_tokens")
                          or body.get("max_output_tokens"))  # fmt: skip
        decision = decide(self.config, targets, self.count_isl(body), max_tokens)
        logger.debug("global router: %s", decision.reason)
        candidates = [self._frontend_of(decision)]
        if self.config.raw.retry_faster:  # a pair walks on from the pools before its prefill's
            for n in self.config.faster_than(decision.retry_from):
                pool = self.config.pools[n]
                candidates.append(Frontend(n, pool.url, pool.namespace))
        failures: list[_Failed] = []
        for fe in candidates:
            result = await self._forward(request, fe, "POST", payload, headers)
            if isinstance(result, web.StreamResponse):
                return result
            failures.append(result)
            logger.info("global router: pool %s failed before the first byte (%s)",
                        fe.label, result.why)  # fmt: skip
        return self._failed(failures)

    def _frontend_of(self, decision: Decision) -> Frontend:
        if decision.pool in self.config.pools:
            return Frontend(decision.pool, decision.url, self.config.pools[decision.pool].namespace)
        prefill = self.config.pools[decision.retry_from]  # a pair: its prefill pool's namespace
        return Frontend(decision.pool, decision.url, prefill.namespace)

    async def _continue_response(self, request: web.Request, previous: str, payload: bytes,
                                 headers: CIMultiDict[str]) -> web.StreamResponse:  # fmt: skip
        """POST /v1/responses with previous_response_id: to the frontend that stores it."""
        holder, answer = await self._ask_in_turn(f"/v1/responses/{previous}", "GET", headers)
        if holder is None or answer.status != 200:  # none holds it, or the lookup was refused
            return answer
        result = await self._forward(request, holder, "POST", payload, headers)
        return result if isinstance(result, web.StreamResponse) else self._failed([result])

    async def _forward(self, request: web.Request, fe: Frontend, method: str, payload: bytes,
                       headers: CIMultiDict[str]) -> web.StreamResponse | _Failed:  # fmt: skip
        """The client's response once the pool answered well, or why it did not."""
        assert self.session is not None
        wrong = await self._wrong_namespace(fe)
        if wrong:
            return _Failed(wrong)
        try:
            upstream = await self.session.request(
                method, fe.url + request.path_qs, data=payload or None, headers=headers
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _Failed(f"{fe.label}: {type(exc).__name__}: {exc}")
        async with upstream:
            if upstream.status in RETRYABLE:
                return _Failed(
                    f"{fe.label}: HTTP {upstream.status}",
                    pool=fe.label,
                    status=upstream.status,
                    body=await _read_quietly(upstream),
                    headers=returned_headers(upstream.status, upstream.headers),
                )
            self.num_routed[fe.label] = self.num_routed.get(fe.label, 0) + 1
            response = web.StreamResponse(status=upstream.status)
            for name, value in returned_headers(upstream.status, upstream.headers):
                response.headers.add(name, value)
            response.headers["x-tandem-pool"] = fe.label
            await response.prepare(request)  # the first byte: no retry from here on
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def _failed(self, failures: list[_Failed]) -> web.Response:
        """Every candidate failed: the last pool's own answer, else a 503 naming why."""
        answered = [f for f in failures if f.status]
        if answered:
            last = answered[-1]
            return _relay(last.status, last.body, last.headers or [], pool=last.pool)
        why = failures[-1].why if failures else "no pool answered"
        return _error(503, f"every candidate pool failed: {why}", "service_unavailable")

    async def _wrong_namespace(self, fe: Frontend) -> str:
        """Why `fe` must not be used ('' when it may): its /health names another namespace."""
        if fe.url in self._namespace_ok:
            return ""
        assert self.session is not None
        try:
            async with self.session.get(
                fe.url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                report = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return ""  # unreachable or no report: the request itself finds out
        served = report.get("namespace") if isinstance(report, dict) else None
        if served == fe.namespace:
            self._namespace_ok.add(fe.url)
            return ""
        why = (f"{fe.label}: the frontend at {fe.url} serves namespace {served!r}, not the "
               f"configured {fe.namespace!r}")  # fmt: skip
        logger.error("global router: %s; fix the pool's url or namespace", why)
        return why

    # ------------------------------------------------------------------ GET / DELETE routes
    async def models(self, request: web.Request) -> web.Response:
        """Every pool's models, each id once (fastest pool first); a pool that refuses (401)
        is answered as it answered when no pool lists any."""
        headers = forwarded_headers(request.headers)
        answers = await asyncio.gather(
            *(self._get_json(fe, "/v1/models", "GET", headers) for fe in self.frontends)
        )
        data: dict[str, Any] = {}
        refused: Answer | None = None
        for fe, answer in zip(self.frontends, answers, strict=True):
            if answer is None or await self._wrong_namespace(fe):
                continue
            if answer[0] == 200:
                for model in _model_list(answer[1]):
                    data.setdefault(model["id"], model)
            elif refused is None:
                refused = answer
        if data:
            return web.json_response({"object": "list", "data": list(data.values())})
        if refused is not None:  # e.g. every pool's 401: the client learns why
            return _relay(*refused)
        return _error(503, "no pool answered /v1/models", "service_unavailable")

    async def lookup(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}, GET/DELETE /v1/responses/{id}: the first frontend that knows."""
        headers = forwarded_headers(request.headers)
        return (await self._ask_in_turn(request.path_qs, request.method, headers))[1]

    async def _ask_in_turn(
        self, path: str, method: str, headers: CIMultiDict[str]
    ) -> tuple[Frontend | None, web.Response]:
        """Ask each frontend, fastest first: the first answer that is not a 404 and who gave
        it, else the last 404 (None: no frontend knows), else a 503."""
        last: web.Response | None = None
        for fe in self.frontends:
            if await self._wrong_namespace(fe):
                continue
            answer = await self._get_json(fe, path, method, headers)
            if answer is None:
                continue
            response = _relay(*answer, pool=fe.label)
            if answer[0] != 404:
                return fe, response
            last = response
        return None, last or _error(503, f"no pool answered {method} {path}", "service_unavailable")

    async def _get_json(
        self, fe: Frontend, path: str, method: str, headers: CIMultiDict[str]
    ) -> Answer | None:
        assert self.session is not None
        try:
            async with self.session.request(
                method, fe.url + path, headers=headers,
                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
            ) as resp:  # fmt: skip
                return resp.status, await resp.read(), returned_headers(resp.status, resp.headers)
        except (aiohttp.ClientError, TimeoutError):
            return None

    # ------------------------------------------------------------------ probes
    async def live(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def health(self, _request: web.Request) -> web.Response:
        """200 while at least one frontend reports healthy; each frontend's status listed."""
        assert self.session is not None

        async def status(fe: Frontend) -> str:
            try:
                async with self.session.get(  # type: ignore[union-attr]
                    fe.url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
                ) as resp:
                    return "healthy" if resp.status == 200 else f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                return f"unreachable: {type(exc).__name__}"

        states = await asyncio.gather(*(status(fe) for fe in self.frontends))
        pools = {fe.label: s for fe, s in zip(self.frontends, states, strict=True)}
        healthy = "healthy" in states
        body = {"status": "healthy" if healthy else "unhealthy", "pools": pools}
        return web.json_response(body, status=200 if healthy else 503)


def _relay(
    status: int, body: bytes, returned: list[tuple[str, str]], pool: str = ""
) -> web.Response:
    headers = CIMultiDict(returned)
    if pool:
        headers["x-tandem-pool"] = pool
    return web.Response(status=status, body=body, headers=headers)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """The router's own answers (merged /v1/models, errors) carry the client's X-Request-ID
    too; the pools' answers carry theirs."""
    client_id = request.headers.get("x-request-id")
    if client_id is not None and "x-request-id" not in response.headers:
        response.headers["x-request-id"] = client_id


def _model_list(body: bytes) -> list[dict[str, Any]]:
    """The entries of a /v1/models answer that have an id ([] for anything else)."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return []
    if not isinstance(data, list):
        return []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)
        ]
    return []


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""
