"""The frontend's /metrics and /metrics/workers on a live in-process stack (two mocker workers,
memory discovery, TCP request plane): every API request is counted with its outcome and status
code, including the ones rejected before routing (bad JSON 400, unknown model 404, unknown route
404, admission 503); `HEAD /metrics` answers 200 with its headers; both expositions pass
`promtool check metrics`; /metrics/workers merges every worker's series (labelled by worker_id)
and /metrics/workers/{id} is one worker's."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from tests.support.frontend_stack import start_frontend_task
from tests.support.prometheus import needs_promtool, promtool_check
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.config import FrontendConfig
from tandem.router.config import RouterConfig
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.metrics import parse
from tandem.runtime.runtime import open_runtime

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
REQUESTS = "tandem_frontend_requests_total"


class Stack:
    def __init__(self, exit_stack: AsyncExitStack, http: aiohttp.ClientSession, base: str):
        self.exit_stack, self.http, self.base = exit_stack, http, base

    async def get(self, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        async with self.http.request(method, f"{self.base}{path}") as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def post(self, path: str, body: Any) -> int:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(f"{self.base}{path}", data=data) as resp:
            await resp.read()
            return resp.status

    async def metrics(self, path: str = "/metrics") -> dict[str, dict[Any, float]]:
        status, _, body = await self.get(path)
        assert status == 200, body
        return parse(body.decode())


async def _stack(
    exit_stack: AsyncExitStack, speedup_ratio: float = 0, **config: Any
) -> tuple[Stack, list[Worker]]:
    discovery, events = MemoryDiscovery(), MemoryEventBus()
    workers = []
    for _ in range(2):
        rt = await exit_stack.enter_async_context(
            open_runtime(RuntimeConfig(), discovery=discovery, events=events)
        )
        engine = MockerEngine(
            MockerConfig(
                num_blocks=256,
                block_size=16,
                speedup_ratio=speedup_ratio,
                tokenizer=f"gguf:{smollm2_gguf()}",
            )
        )
        worker = Worker(engine, rt, WorkerConfig(metrics_period_s=0.1, stats_period_s=0.05))
        await worker.start()
        exit_stack.push_async_callback(worker.stop, 0)
        workers.append(worker)
    rt = await exit_stack.enter_async_context(
        open_runtime(RuntimeConfig(), discovery=discovery, events=events)
    )
    base, http = await start_frontend_task(exit_stack, rt, FrontendConfig(port=0, **config))
    return Stack(exit_stack, http, base), workers


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], **kw}


def _count(m: dict[str, dict[Any, float]], **labels: str) -> float:
    """Sum of requests_total over the series that carry all of `labels`."""
    want = set(labels.items())
    return sum(v for k, v in m.get(REQUESTS, {}).items() if want <= set(k))


async def _inflight(s: Stack) -> float:
    return (
        (await s.metrics()).get("tandem_frontend_inflight_requests", {}).get((("model", MODEL),), 0)
    )


async def _until_served(s: Stack) -> None:
    async with asyncio.timeout(30):
        while await s.post("/v1/chat/completions", _chat(max_tokens=2)) != 200:  # noqa: ASYNC110 - over HTTP
            await asyncio.sleep(0.05)


async def test_every_request_is_counted_with_its_status_and_promtool_passes() -> None:
    async with AsyncExitStack() as exit_stack:
        s, _ = await _stack(exit_stack, router_policy="kv", router=RouterConfig(seed=0))
        await _until_served(s)
        before = await s.metrics()
        ok = _count(before, model=MODEL, status="success", status_code="200")
        assert ok >= 1
        assert await s.post("/v1/chat/completions", _chat(max_tokens=3, stream=True)) == 200
        assert await s.post("/v1/chat/completions", b"{not json") == 400
        assert await s.post("/v1/chat/completions", {**_chat(), "model": "nope"}) == 404
        assert await s.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}) == 400
        assert (await s.get("/v1/nothing"))[0] == 404
        m = await s.metrics()
        stream_ok = _count(m, model=MODEL, request_type="stream", status_code="200")
        assert stream_ok == _count(before, model=MODEL, request_type="stream") + 1
        assert _count(m, model=MODEL, status="success", status_code="200") == ok + 1
        # rejected before the model was known: no model label value (bounded cardinality)
        assert _count(m, model="", endpoint="chat_completions", status_code="400") == 1
        assert _count(m, model="", endpoint="chat_completions", status_code="404") == 1
        assert _count(m, endpoint="completions", status="error", status_code="400") == 1
        assert _count(m, endpoint="other", status_code="404") == 1
        assert m["tandem_frontend_output_tokens_total"][(("model", MODEL),)] >= 3
        assert m["tandem_frontend_inflight_requests"][(("model", MODEL),)] == 0
        assert m["tandem_frontend_queued_requests"][(("model", MODEL),)] == 0
        assert m["tandem_frontend_time_to_first_token_seconds_count"][(("model", MODEL),)] >= 2
        assert any(k for k in m["tandem_frontend_worker_active_decode_blocks"])
        overhead = m["tandem_router_overhead_seconds_count"]
        assert overhead[(("component", "backend"), ("model", MODEL))] >= 2
        status, headers, body = await s.get("/metrics", method="HEAD")
        assert status == 200 and body == b""
        assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert int(headers["Content-Length"]) > 1000


async def test_admission_reject_is_counted_as_503() -> None:
    async with AsyncExitStack() as exit_stack:
        s, _ = await _stack(exit_stack, speedup_ratio=1, max_inflight_requests=1)
        await _until_served(s)
        slow = asyncio.create_task(s.post("/v1/chat/completions", _chat(max_tokens=400)))
        async with asyncio.timeout(10):
            while not await _inflight(s):  # noqa: ASYNC110 - over HTTP
                await asyncio.sleep(0.01)
        assert await s.post("/v1/chat/completions", _chat(max_tokens=2)) == 503
        slow.cancel()
        m = await s.metrics()
        assert _count(m, model=MODEL, status="error", status_code="503") == 1


@needs_promtool
async def test_frontend_and_merged_worker_metrics_pass_promtool() -> None:
    async with AsyncExitStack() as exit_stack:
        s, workers = await _stack(exit_stack, router_policy="kv")
        await _until_served(s)
        for path in ("/metrics", "/metrics/workers", f"/metrics/workers/{workers[0].instance_id}"):
            status, _, body = await s.get(path)
            assert status == 200
            promtool_check(body)


async def test_metrics_workers_merges_every_worker_and_serves_one_by_id() -> None:
    async with AsyncExitStack() as exit_stack:
        s, workers = await _stack(exit_stack)
        await _until_served(s)
        ids = sorted(w.instance_id for w in workers)
        m = await s.metrics("/metrics/workers")
        up = {dict(k)["worker_id"]: v for k, v in m["tandem_worker_up"].items()}
        assert up == dict.fromkeys(ids, 1)
        states = {dict(k)["worker_id"] for k in m["tandem_worker_state"]}
        assert states == set(ids)
        served = sum(v for k, v in m["tandem_worker_requests_total"].items())
        assert served >= 1
        assert sum(m["tandem_worker_kv_total_blocks"].values()) == 512
        assert {dict(k)["model"] for k in m["tandem_worker_kv_total_blocks"]} == {MODEL}
        one = await s.metrics(f"/metrics/workers/{ids[0]}")
        assert {dict(k)["worker_id"] for k in one["tandem_worker_state"]} == {ids[0]}
        assert (await s.get("/metrics/workers/nope"))[0] == 404
