"""`FrontendStack`: a real frontend and its workers in one process (memory discovery and
events, TCP request plane), driven over HTTP with aiohttp. Workers are any `Engine` hosted
by a `Worker` (mocker, native) or a raw request-plane handler."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp

from tandem.engines.base import Engine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.config import FrontendConfig
from tandem.frontend.serve import serve_frontend
from tandem.protocols.discovery import ModelCard
from tandem.runtime.base import Discovery
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime

Handler = Callable[[bytes, Any], AsyncIterator[bytes]]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


async def start_frontend_task(
    exit_stack: AsyncExitStack, rt: Runtime, config: FrontendConfig
) -> tuple[str, aiohttp.ClientSession]:
    """`serve_frontend` on `rt` as a task stopped by `exit_stack`; returns its base URL once
    bound and a client session closed by `exit_stack`."""
    ready, stop, bound = asyncio.Event(), asyncio.Event(), []
    task = asyncio.create_task(serve_frontend(config, rt, ready=ready, stop=stop, bound=bound))

    async def shutdown() -> None:
        stop.set()
        await task

    exit_stack.push_async_callback(shutdown)
    await asyncio.wait_for(ready.wait(), 10)
    host, port = bound[0]
    http = await exit_stack.enter_async_context(aiohttp.ClientSession())
    return f"http://{host}:{port}", http


class FrontendStack:
    """Everything it starts is stopped when `exit_stack` closes."""

    def __init__(self, exit_stack: AsyncExitStack) -> None:
        self.exit_stack = exit_stack
        # any Discovery: a test may share a file one with worker processes
        self.discovery: Discovery = MemoryDiscovery()
        self.events = MemoryEventBus()
        self.base = ""
        self.http: aiohttp.ClientSession | None = None
        self.workers: list[Worker] = []
        self.headers: dict[str, str] = {}  # sent with `post` (a stack with API keys: the first)

    async def runtime(self) -> Runtime:
        return await self.exit_stack.enter_async_context(
            open_runtime(RuntimeConfig(), discovery=self.discovery, events=self.events)
        )

    async def add_worker(self, engine: Engine) -> Worker:
        worker = Worker(engine, await self.runtime(), WorkerConfig())
        await worker.start()
        self.exit_stack.push_async_callback(worker.stop, 0)
        self.workers.append(worker)
        return worker

    async def add_handler(self, handler: Handler, card: ModelCard) -> None:
        rt = await self.runtime()
        await rt.serve_endpoint("backend", "generate", handler, model=card)

    async def start_frontend(
        self, ready_body: dict[str, Any], *, ready_path: str = CHAT, **config: Any
    ) -> None:
        """Serve on a free port (`config`: FrontendConfig fields); return once `ready_body`
        sent to `ready_path` gets a 200 (workers discovered, the model's tokenizer loaded).
        With `api_keys`, `post` sends the first as a Bearer key."""
        if keys := config.get("api_keys"):
            self.headers = {"authorization": f"Bearer {keys[0]}"}
        rt = await self.runtime()
        self.base, self.http = await start_frontend_task(
            self.exit_stack, rt, FrontendConfig(port=0, **config)
        )
        async with asyncio.timeout(30):
            while (await self.post(ready_path, ready_body))[0] != 200:  # noqa: ASYNC110 - over HTTP
                await asyncio.sleep(0.05)

    async def get(self, path: str) -> tuple[int, str]:
        assert self.http is not None
        async with self.http.get(f"{self.base}{path}") as resp:
            return resp.status, await resp.text()

    async def post(self, path: str, body: Any) -> tuple[int, Any, dict[str, str]]:
        """POST a dict (as JSON) or raw bytes; the body comes back parsed when it is JSON."""
        assert self.http is not None
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(f"{self.base}{path}", data=data, headers=self.headers) as resp:
            text = await resp.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text  # an SSE stream
            return resp.status, parsed, dict(resp.headers)

    async def post_all(
        self,
        bodies: list[tuple[str, Any]],
        check: Callable[[str, Any, int, Any], None],
        *,
        concurrency: int = 4,
    ) -> dict[int, int]:
        """POST every (path, body), `concurrency` at a time, each within 15 s and all within
        60 s; `check(path, body, status, reply)` sees every answer. How many answers had each
        status (the fuzz tests' loop)."""
        sem = asyncio.Semaphore(concurrency)
        statuses: dict[int, int] = {}

        async def send(path: str, body: Any) -> None:
            async with sem, asyncio.timeout(15):
                status, reply, _ = await self.post(path, body)
            statuses[status] = statuses.get(status, 0) + 1
            check(path, body, status, reply)

        async with asyncio.timeout(60):
            await asyncio.gather(*(send(path, body) for path, body in bodies))
        return statuses

    async def instance_ids(self, model: str) -> list[str]:
        _, text = await self.get("/health")
        return list(json.loads(text)["instances"].get(model, []))

    async def inflight_on_workers(self) -> list[float]:
        """The router's in-flight count of every worker, from /metrics."""
        _, text = await self.get("/metrics")
        pattern = r'^tandem_frontend_worker_load\{[^}]*metric="inflight"[^}]*\} (\S+)$'
        return [float(v) for v in re.findall(pattern, text, re.M)]
