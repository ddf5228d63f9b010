"""Frontend admission, route explain and re-routing, in one process (memory discovery/events,
TCP request plane): the in-flight bound answers 503 + Retry-After and holds under a burst;
`POST /v1/route/explain` returns the router's view (KV overlap with a real mocker worker);
a worker that refuses a request before its first output costs no migration."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from tests.support.frontend_stack import start_frontend_task
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.errors import PeerGone
from tandem.frontend.config import FrontendConfig
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import EngineOutput, decode_request, encode
from tandem.router.config import RouterConfig
from tandem.router.policy_router import RoundRobinRouter
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime

pytestmark = pytest.mark.timeout(30)
MODEL = "smollm2"
Handler = Callable[[bytes, Any], AsyncIterator[bytes]]


def _gguf() -> str:
    return f"gguf:{smollm2_gguf()}"


CARD = ModelCard(
    name=MODEL, context_length=512, block_size=16, num_total_blocks=1024, tokenizer=_gguf()
)


ADMIN_KEY = "admin-key-1"


class Stack:
    def __init__(self, exit_stack: AsyncExitStack) -> None:
        self.exit_stack = exit_stack
        self.discovery, self.events = MemoryDiscovery(), MemoryEventBus()
        self.base = ""
        self.http: aiohttp.ClientSession | None = None
        self.headers: dict[str, str] = {}  # sent with every POST

    async def runtime(self) -> Runtime:
        return await self.exit_stack.enter_async_context(
            open_runtime(RuntimeConfig(), discovery=self.discovery, events=self.events)
        )

    async def add_handler(self, handler: Handler) -> None:
        rt = await self.runtime()
        await rt.serve_endpoint("backend", "generate", handler, model=CARD)

    async def start_frontend(self, num_workers: int, **config: Any) -> None:
        rt = await self.runtime()
        self.base, self.http = await start_frontend_task(
            self.exit_stack, rt, FrontendConfig(port=0, **config)
        )

        async def discovered() -> bool:
            return len(await self.instance_ids()) >= num_workers

        await _until(discovered)

    async def instance_ids(self) -> list[str]:
        assert self.http is not None
        async with self.http.get(f"{self.base}/health") as resp:
            return list((await resp.json())["instances"].get(MODEL, []))

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        assert self.http is not None
        async with self.http.post(f"{self.base}{path}", json=body, headers=self.headers) as resp:
            return resp.status, await resp.json(), dict(resp.headers)


def _completion(max_tokens: int = 3, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": list(range(40, 80)), "max_tokens": max_tokens, **kw}


def gated_worker(gate: asyncio.Event, started: list[str]) -> Handler:
    """Emits one token per request once `gate` is set; records the requests it holds."""

    async def handler(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        req = decode_request(payload)
        started.append(req.request_id)
        await gate.wait()
        for i in range(req.stop.max_tokens):
            last = i + 1 == req.stop.max_tokens
            yield encode(
                EngineOutput(token_ids=[100 + i], finish_reason="length" if last else None)
            )

    return handler


async def _until(predicate: Callable[[], bool] | Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(10):
        while True:
            result = predicate()
            if await result if asyncio.iscoroutine(result) else result:
                return
            await asyncio.sleep(0.01)


async def test_overload_is_503_with_retry_after_and_the_bound_holds_in_a_burst() -> None:
    async with AsyncExitStack() as exit_stack:
        s, gate, started = Stack(exit_stack), asyncio.Event(), []
        await s.add_handler(gated_worker(gate, started))
        await s.start_frontend(1, max_inflight_requests=2, retry_after_s=3.0)
        burst = [asyncio.create_task(s.post("/v1/completions", _completion())) for _ in range(10)]
        await _until(lambda: len(started) == 2 and sum(t.done() for t in burst) == 8)
        rejected = [t.result() for t in burst if t.done()]
        for status, body, headers in rejected:
            assert status == 503
            assert headers["Retry-After"] == "3"
            assert "limit 2" in body["error"]["message"]
        gate.set()
        results = await asyncio.gather(*burst)
        assert sorted(status for status, _, _ in results) == [200] * 2 + [503] * 8
        status, body, _ = await s.post("/v1/completions", _completion())  # slots released
        assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_max_inflight_requests_defaults_to_a_bound() -> None:
    assert FrontendConfig().max_inflight_requests == 1024
    with pytest.raises(ValueError, match="max_inflight_requests=0"):
        FrontendConfig(max_inflight_requests=0)


async def test_request_refused_before_first_output_is_routed_again_without_migration() -> None:
    refused: list[str] = []

    async def draining(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        refused.append(decode_request(payload).request_id)
        raise PeerGone("worker is draining; retry on another instance")
        yield b""  # pragma: no cover - makes this an async generator

    async with AsyncExitStack() as exit_stack:
        s, gate, served = Stack(exit_stack), asyncio.Event(), []
        gate.set()
        await s.add_handler(draining)
        await s.add_handler(gated_worker(gate, served))
        await s.start_frontend(2, migration_limit=0)
        for _ in range(4):  # round robin: some of them meet the draining worker first
            status, body, _ = await s.post("/v1/completions", _completion(max_tokens=2))
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 2
        assert refused and len(served) == 4


async def test_stream_broken_after_output_still_needs_the_migration_budget() -> None:
    async def dies_mid_stream(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        yield encode(EngineOutput(token_ids=[101]))
        raise PeerGone("worker died")

    async with AsyncExitStack() as exit_stack:
        s = Stack(exit_stack)
        await s.add_handler(dies_mid_stream)
        gate, served = asyncio.Event(), []
        gate.set()
        await s.add_handler(gated_worker(gate, served))
        await s.start_frontend(2, migration_limit=0)
        statuses = [(await s.post("/v1/completions", _completion()))[0] for _ in range(2)]
        assert sorted(statuses) == [200, 503]


async def test_route_explain_round_robin_and_errors() -> None:
    async with AsyncExitStack() as exit_stack:
        s, gate = Stack(exit_stack), asyncio.Event()
        for _ in range(2):
            await s.add_handler(gated_worker(gate, []))
        await s.start_frontend(2, admin_api_keys=(ADMIN_KEY,))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        status, body, _ = await s.post("/v1/route/explain", chat)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        s.headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        status, body, _ = await s.post("/v1/route/explain", chat)
        assert status == 200
        assert body["policy"] == "round_robin"
        assert sorted(c["worker_id"] for c in body["candidates"]) == sorted(await s.instance_ids())
        status, body, _ = await s.post("/v1/route/explain", {**chat, "model": "nope"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body, _ = await s.post("/v1/route/explain", {**chat, "max_tokens": "many"})
        assert status == 400 and body["error"]["param"] == "max_tokens"


async def test_route_explain_kv_router_sees_the_cached_prefix_of_a_mocker_worker() -> None:
    async with AsyncExitStack() as exit_stack:
        s = Stack(exit_stack)
        for _ in range(2):
            rt = await s.runtime()
            engine = MockerEngine(
                MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0, tokenizer=_gguf())
            )
            worker = Worker(engine, rt, WorkerConfig(metrics_period_s=0.1))
            await worker.start()
            exit_stack.push_async_callback(worker.stop, 0)
        await s.start_frontend(
            2, router_policy="kv", router=RouterConfig(seed=1), admin_api_keys=(ADMIN_KEY,)
        )
        s.headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        prompt = _completion(max_tokens=2, prompt=list(range(300, 364)))  # 4 full blocks
        status, before, _ = await s.post("/v1/route/explain", prompt)
        assert status == 200 and before["policy"] == "kv" and before["request_blocks"] == 4
        assert all(c["overlap_blocks"] == 0 for c in before["candidates"])
        status, _, _ = await s.post("/v1/completions", prompt)
        assert status == 200

        async def overlap_seen() -> bool:
            _, after, _ = await s.post("/v1/route/explain", prompt)
            best = max(after["candidates"], key=lambda c: c["overlap_blocks"])
            return best["overlap_blocks"] == 4 and after["choice"] == best["worker_id"]

        await _until(overlap_seen)


async def test_route_explain_is_404_for_a_policy_that_cannot_explain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def cannot(self: object, request: object) -> dict[str, Any]:
        raise NotImplementedError

    monkeypatch.setattr(RoundRobinRouter, "explain", cannot)
    async with AsyncExitStack() as exit_stack:
        s = Stack(exit_stack)
        await s.add_handler(gated_worker(asyncio.Event(), []))
        await s.start_frontend(1, admin_api_keys=(ADMIN_KEY,))
        s.headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        status, body, _ = await s.post("/v1/route/explain", _completion())
        assert status == 404
        assert "cannot explain" in body["error"]["message"]
