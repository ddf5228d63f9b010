"""The global router's HTTP proxy: OpenAI requests in, forwarded to the chosen pool's frontend.

The response is streamed back as it arrives. Before the first byte reaches the client, a pool
that fails (connection refused, 429 or 5xx: no workers, overloaded) hands the request to the
next faster pool (a prefill-first pair: the next pool with a frontend listed before its
prefill pool); after it, the client sees the pool's stream and its errors as they are.
Every response carries `x-tandem-pool`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from tandem.errors import InvalidRequest
from tandem.planner.global_router.config import GlobalRouterConfig
from tandem.planner.global_router.decision import decide, targets_from
from tandem.tokens.tokenizer import ModelTokenizer

logger = logging.getLogger(__name__)
RETRYABLE = {429, 500, 502, 503, 504}
CONNECT_TIMEOUT_S = 5.0


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status)


class GlobalRouterApp:
    def __init__(self, config: GlobalRouterConfig, tokenizer: ModelTokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.session: aiohttp.ClientSession | None = None
        self.num_routed: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def _close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def count_isl(self, body: dict[str, Any]) -> int:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, list):
            text = "".join(p if isinstance(p, str) else "" for p in prompt)
        elif isinstance(prompt, str):
            text = prompt
        else:
            parts = []
            for m in body.get("messages") or []:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    parts += [c.get("text", "") for c in content if isinstance(c, dict)]
            text = "\n".join(parts)
        if self.tokenizer is None:
            return max(len(text) // 4, 1)  # no tokenizer configured: ~4 characters a token
        return len(self.tokenizer.encode(text))

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
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
        decision = decide(self.config, targets, self.count_isl(body), max_tokens)
        logger.debug("global router: %s", decision.reason)
        payload = json.dumps(body).encode()
        candidates = [(decision.pool, decision.url)]
        if self.config.raw.retry_faster:  # a pair walks on from the pools before its prefill's
            faster = self.config.faster_than(decision.retry_from)
            candidates += [(n, self.config.pools[n].url) for n in faster]
        last_error = "no pool answered"
        for pool, url in candidates:
            response = await self._forward(request, pool, url, payload)
            if isinstance(response, web.StreamResponse):
                return response
            last_error = response
            logger.info("global router: pool %s failed before the first byte (%s)", pool, response)
        return _error(503, f"every candidate pool failed: {last_error}", "service_unavailable")

    async def _forward(self, request: web.Request, pool: str, url: str,
                       payload: bytes) -> web.StreamResponse | str:  # fmt: skip
        """The client's response once the pool answered well, or why it did not."""
        assert self.session is not None
        try:
            upstream = await self.session.post(
                url + request.path, data=payload, headers={"content-type": "application/json"}
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{pool}: {type(exc).__name__}: {exc}"
        async with upstream:
            if upstream.status in RETRYABLE:
                return f"{pool}: HTTP {upstream.status}"
            self.num_routed[pool] = self.num_routed.get(pool, 0) + 1
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            response.headers["x-tandem-pool"] = pool
            await response.prepare(request)  # the first byte: no retry from here on
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for name in self.config.order:
            url = self.config.pools[name].url
            if not url:
                continue
            try:
                async with self.session.get(url + "/v1/models") as resp:
                    if resp.status == 200:
                        return web.json_response(await resp.json())
            except (aiohttp.ClientError, TimeoutError):
                continue
        return _error(503, "no pool answered /v1/models", "service_unavailable")
