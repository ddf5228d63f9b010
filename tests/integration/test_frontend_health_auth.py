"""/health and /live tell the truth, HEAD works where GET does, and API keys guard the OpenAI
routes — in one process (memory discovery/events, TCP request plane, mocker workers)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from tests.support.smollm2 import smollm2_mocker

from tandem.disagg.config import DisaggRouteConfig
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.config import FrontendConfig
from tandem.frontend.serve import serve_frontend
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import open_runtime

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"


class Cluster:
    def __init__(self, stack: AsyncExitStack) -> None:
        self.stack = stack
        self.discovery, self.events = MemoryDiscovery(), MemoryEventBus()
        self.base = ""

    async def runtime(self) -> Any:
        return await self.stack.enter_async_context(
            open_runtime(RuntimeConfig(), discovery=self.discovery, events=self.events)
        )

    async def add_worker(self, component: str = "backend", **metadata: Any) -> Worker:
        engine = smollm2_mocker(MODEL)
        config = WorkerConfig(component=component, metrics_period_s=0.1, metadata=metadata)
        worker = Worker(engine, await self.runtime(), config)
        await worker.start()
        self.stack.push_async_callback(worker.stop, 0)
        return worker

    async def start_frontend(self, **config: Any) -> None:
        ready, stop, bound = asyncio.Event(), asyncio.Event(), []
        task = asyncio.create_task(
            serve_frontend(
                FrontendConfig(port=0, **config),
                await self.runtime(),
                ready=ready,
                stop=stop,
                bound=bound,
            )
        )

        async def shutdown() -> None:
            stop.set()
            await task

        self.stack.push_async_callback(shutdown)
        await asyncio.wait_for(ready.wait(), 10)
        host, port = bound[0]
        self.base = f"http://{host}:{port}"

    async def get(self, path: str, method: str = "GET", **kw: Any) -> tuple[int, Any, bytes]:
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, f"{self.base}{path}", **kw) as resp,
        ):
            raw = await resp.read()
            return resp.status, dict(resp.headers), raw


@asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        yield Cluster(stack)


async def _health(c: Cluster) -> tuple[int, dict[str, Any]]:
    status, _, raw = await c.get("/health")
    return status, json.loads(raw)


async def _wait_health(c: Cluster, pred: Any, timeout_s: float = 10.0) -> tuple[int, Any]:
    """Poll /health until `pred(status, body)`; the last answer in the failure message."""
    last: tuple[int, Any] = (0, None)
    try:
        async with asyncio.timeout(timeout_s):
            while not pred(*(last := await _health(c))):  # noqa: ASYNC110 - polled over HTTP
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"/health never satisfied the check; last {last}") from None
    return last


async def test_health_is_503_while_a_worker_is_silent_and_names_it() -> None:
    async with cluster() as c:
        worker = await c.add_worker()
        await c.start_frontend(health_stale_s=0.5)
        _, body = await _wait_health(c, lambda status, body: status == 200)
        assert body["models"][MODEL]["status"] == "ready"
        assert body["discovery"]["status"] == "ok" and body["event_bus"]["status"] == "ok"

        async def silent(load: Any) -> None:  # the engine stops reporting (frozen, dead loop)
            return None

        worker._send_load = silent  # type: ignore[method-assign]
        _, body = await _wait_health(c, lambda status, body: status == 503)
        assert body["models"][MODEL]["status"] == "not_ready"
        assert any(f"worker {worker.instance_id} is not alive" in m for m in body["missing"])


async def test_disaggregated_model_needs_a_prefill_worker() -> None:
    async with cluster() as c:
        await c.add_worker("backend")  # decode only
        await c.start_frontend(disagg=DisaggRouteConfig(enabled=True))
        status, body = await _wait_health(c, lambda status, body: MODEL in body["models"])
        assert status == 503
        assert any("no prefill worker" in m for m in body["models"][MODEL]["missing"])
        await c.add_worker("prefill")
        status, body = await _wait_health(c, lambda status, body: status == 200)
        assert len(body["models"][MODEL]["prefill_workers"]) == 1


async def test_remote_only_image_workers_need_an_encode_worker() -> None:
    async with cluster() as c:
        await c.add_worker(needs_encoder=True)  # E/PD: this worker cannot encode itself
        await c.start_frontend()
        status, body = await _wait_health(c, lambda status, body: MODEL in body["models"])
        assert status == 503
        assert any("no encode worker" in m for m in body["models"][MODEL]["missing"])

        async def encode(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
            yield b""

        encoder = await (await c.runtime()).serve_endpoint("encoder", "encode", encode)
        status, body = await _wait_health(c, lambda status, body: status == 200)
        assert body["models"][MODEL]["encode_workers"] == [encoder.instance_id]


async def test_head_works_where_get_does_and_live_answers() -> None:
    async with cluster() as c:
        await c.add_worker()
        await c.start_frontend()
        # ready first: /health turns 200 once the frontend has seen the worker, and a GET
        # and a HEAD on either side of that moment would rightly differ
        await _wait_health(c, lambda status, body: status == 200)
        for path in ("/health", "/metrics", "/v1/models", "/live"):
            get_status, _, _ = await c.get(path)
            status, headers, body = await c.get(path, method="HEAD")
            assert status == get_status and status in (200, 503), (path, status)
            assert body == b"" and "Date" in headers and int(headers["Content-Length"]) > 0
        status, _, raw = await c.get("/live")
        assert status == 200 and json.loads(raw)["status"] == "live"


async def test_api_keys_guard_openai_routes_and_admin_routes_are_off_without_a_key() -> None:
    async with cluster() as c:
        await c.add_worker()
        await c.start_frontend(api_keys=("key-one", "key-two"))
        base = f"{c.base}/v1"
        wrong = openai.AsyncOpenAI(base_url=base, api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            await wrong.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        status, headers, raw = await c.get("/v1/models")  # no Authorization header
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in json.loads(raw)["error"]["message"]
        for key in ("key-one", "key-two"):
            client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
            out = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert out.usage is not None and out.usage.completion_tokens == 2
            await client.close()
        await wrong.close()
        assert (await c.get("/health"))[0] in (200, 503)  # open: never 401
        assert (await c.get("/live"))[0] == 200
        status, _, raw = await c.get(
            "/v1/route/explain",
            method="POST",
            json={"model": MODEL, "prompt": "hi"},
            headers={"Authorization": "Bearer key-one"},
        )
        assert status == 403 and "--admin-api-key" in json.loads(raw)["error"]["message"]
