"""The global router with API keys on, in front of live pools (frontend + mocker worker each,
started with --api-key) and a recording stand-in pool: the client's Authorization,
X-Request-ID and traceparent reach the pool unchanged, hop-by-hop fields do not, every OpenAI
route is routed, stored responses are found in the pool that stores them, and a pool whose
frontend serves another namespace than configured is refused."""

from __future__ import annotations

from collections.abc import Awaitable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from multidict import CIMultiDict
from tests.integration.test_global_router_pools import _pool

from tandem.planner.global_router.app import GlobalRouterApp, forwarded_headers
from tandem.planner.global_router.config import GlobalRouterConfig, GlobalRouterFile

pytestmark = pytest.mark.timeout(60)
KEY, OTHER_KEY = "sk-pool-and-router", "sk-router-only"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OPENAI_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/org/some-model"),
    ("GET", "/v1/responses/resp_1"),
    ("DELETE", "/v1/responses/resp_1"),
]


async def _serve(stack: AsyncExitStack, app: web.Application) -> str:
    runner = web.AppRunner(app)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def _router(stack: AsyncExitStack, pools: list[dict[str, str]], keys: tuple[str, ...]) -> str:
    names = [p["name"] for p in pools]
    grid = {"ttft_ms": [200, 2000], "itl_ms": [50], "pools": [[names[0]], [names[-1]]]}
    raw = {"pools": pools, "aggregated": grid}
    config = GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))
    return await _serve(stack, GlobalRouterApp(config, tokenizer=None, api_keys=keys).app())


class Recorder:
    """A stand-in pool frontend that records each request's method, path and headers."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.seen: list[tuple[str, str, CIMultiDict[str]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.json_response({"status": "healthy", "namespace": self.namespace})
        self.seen.append((request.method, request.path, CIMultiDict(request.headers)))
        body = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        return web.json_response(body, headers={"x-request-id": "pool-echo"})


def test_hop_by_hop_fields_are_dropped_and_the_rest_kept() -> None:
    headers = CIMultiDict([
        ("Authorization", "Bearer k"), ("Connection", "keep-alive, X-Private"),
        ("X-Private", "hop"), ("Keep-Alive", "timeout=5"), ("TE", "trailers"),
        ("Trailer", "x"), ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"),
        ("Proxy-Connection", "keep-alive"), ("Host", "router"), ("Content-Length", "9"),
        ("traceparent", TRACEPARENT), ("X-Request-ID", "r-1"), ("Accept", "a"), ("Accept", "b"),
    ])  # fmt: skip
    out = forwarded_headers(headers)
    assert sorted(k for k, _ in out.items()) == sorted(
        ["Authorization", "traceparent", "X-Request-ID", "Accept", "Accept"]
    )
    assert out.getall("accept") == ["a", "b"]


async def test_every_route_and_end_to_end_header_reaches_the_pool() -> None:
    async with AsyncExitStack() as stack:
        rec = Recorder("rec")
        url = await _serve(stack, rec.app())
        router = await _router(stack, [{"name": "rec", "namespace": "rec", "url": url}], (KEY,))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        sent = {"Authorization": f"Bearer {KEY}", "X-Request-ID": "client-req-7",
                "traceparent": TRACEPARENT, "tracestate": "v=1", "X-Private": "hop",
                "Connection": "X-Private"}  # fmt: skip
        for method, path in OPENAI_ROUTES:
            body = {"model": "m", "prompt": "hi", "input": "hi"} if method == "POST" else None
            async with http.request(method, router + path, json=body, headers=sent) as r:
                assert r.status == 200, (method, path, await r.text())
                # the pool's answer comes back (/v1/models: the router's merge, the client's id)
                echo = "client-req-7" if path == "/v1/models" else "pool-echo"
                assert r.headers["x-request-id"] == echo, path
        assert [(m, p) for m, p, _ in rec.seen] == OPENAI_ROUTES
        for _, _, got in rec.seen:
            assert got["authorization"] == f"Bearer {KEY}"
            assert got["x-request-id"] == "client-req-7" and got["traceparent"] == TRACEPARENT
            assert got["tracestate"] == "v=1" and "x-private" not in got
        # the router's own key is checked first; /health and /live stay open
        async with http.post(router + "/v1/completions", json={"model": "m"}) as r:
            assert r.status == 401 and "needs an API key" in (await r.json())["error"]["message"]
        bad = {"Authorization": "Bearer wrong"}
        async with http.get(router + "/v1/models", headers=bad) as r:
            assert r.status == 401 and r.headers["www-authenticate"].startswith("Bearer")
        for path in ("/health", "/live"):
            async with http.get(router + path) as r:
                assert r.status == 200, path
        assert len(rec.seen) == len(OPENAI_ROUTES)  # nothing refused reached the pool


async def test_a_pool_serving_another_namespace_is_refused() -> None:
    async with AsyncExitStack() as stack:
        url = await _serve(stack, Recorder("cheap").app())
        router = await _router(stack, [{"name": "fast", "namespace": "fast", "url": url}], ())
        http = await stack.enter_async_context(aiohttp.ClientSession())
        async with http.post(router + "/v1/completions", json={"model": "m"}) as r:
            assert r.status == 503
            assert "serves namespace 'cheap', not the configured 'fast'" in await r.text()


async def test_keys_reach_live_pools_and_stored_responses_are_found() -> None:
    async with AsyncExitStack() as stack:
        fast = await _pool(stack, "fast", api_keys=(KEY,))
        cheap = await _pool(stack, "cheap", api_keys=(KEY,))
        pools = [{"name": "fast", "namespace": "fast", "url": fast.base},
                 {"name": "cheap", "namespace": "cheap", "url": cheap.base}]  # fmt: skip
        router = await _router(stack, pools, (KEY, OTHER_KEY))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        def call(method: str, path: str, key: str = KEY, **kw: Any) -> Awaitable[Any]:
            headers = {"Authorization": f"Bearer {key}", "X-Request-ID": "abc-1"}
            return _json(http.request(method, router + path, headers=headers, **kw))

        status, body, headers = await call("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == ["smollm2"]
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3}  # fmt: skip
        status, body, headers = await call("POST", "/v1/chat/completions", json=chat)
        assert status == 200 and headers["x-request-id"] == "abc-1", body
        # the router takes OTHER_KEY; the pools do not: their 401 reaches the client
        status, body, _ = await call("POST", "/v1/chat/completions", OTHER_KEY, json=chat)
        assert status == 401 and "incorrect API key" in body["error"]["message"]
        status, body, _ = await call("GET", "/v1/models", OTHER_KEY)
        assert status == 401
        # a stored response lives in the frontend that made it (cheap: its target), which the
        # router finds after fast's 404
        req = {"model": "smollm2", "input": "hello", "max_output_tokens": 3}
        status, first, headers = await call(
            "POST", "/v1/responses", json={**req, "tandem": {"ttft_target_ms": 1500}}
        )
        assert status == 200 and headers["x-tandem-pool"] == "cheap", first
        status, got, headers = await call("GET", f"/v1/responses/{first['id']}")
        assert status == 200 and got["id"] == first["id"] and headers["x-tandem-pool"] == "cheap"
        # a follow-up whose targets pick `fast` still goes where its previous response is
        follow = {**req, "previous_response_id": first["id"], "tandem": {"ttft_target_ms": 100}}
        status, body, headers = await call("POST", "/v1/responses", json=follow)
        assert status == 200 and headers["x-tandem-pool"] == "cheap", body
        status, _, _ = await call("DELETE", f"/v1/responses/{first['id']}")
        assert status == 200
        status, body, _ = await call("GET", f"/v1/responses/{first['id']}")
        assert status == 404, body
        follow["previous_response_id"] = "resp_unknown"
        status, body, _ = await call("POST", "/v1/responses", json=follow)
        assert status == 404 and "resp_unknown" in body["error"]["message"]
        status, body, _ = await call("GET", "/v1/models/smollm2")
        assert status == 200 and body["id"] == "smollm2"
        status, body, _ = await call(
            "POST", "/tokenize", json={"model": "smollm2", "prompt": "a b"}
        )
        assert status == 200 and body["count"] >= 1, body


async def _json(request: Any) -> tuple[int, Any, Any]:
    async with request as r:
        return r.status, await r.json(content_type=None), r.headers
