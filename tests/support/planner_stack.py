"""A frontend, a planner and mocker workers in one process (memory discovery and events, TCP
request plane), plus an open-loop client that counts failed requests."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from contextlib import AsyncExitStack
from typing import Any

import aiohttp

from tandem.engines.base import Engine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.profile import EngineProfile
from tandem.frontend.config import FrontendConfig
from tandem.planner.config import PlannerConfig
from tandem.planner.connector.inprocess import InProcessConnector
from tandem.planner.control_loop import PlannerService
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime
from tests.support.frontend_stack import start_frontend_task

MODEL = "smollm2"
MOCKER = MockerConfig(block_size=16, num_blocks=4096, max_num_batched_tokens=2048)


def mocker_engine(_component: str) -> Engine:
    return MockerEngine(MOCKER)


class PlannerStack:
    """`runtime_config` None: memory planes shared in-process; else each runtime opens its own
    (file discovery + zmq events reach worker processes)."""

    def __init__(
        self,
        exit_stack: AsyncExitStack,
        runtime_config: RuntimeConfig | None = None,
        *,
        namespace: str = "tandem",  # of the memory planes' runtimes
    ) -> None:
        self.exit_stack = exit_stack
        self.runtime_config = runtime_config
        self.namespace = namespace
        self.discovery, self.events = MemoryDiscovery(), MemoryEventBus()
        self.base = ""
        self.http: aiohttp.ClientSession | None = None
        self.connector: Any = None
        self.service: PlannerService | None = None
        self.results: list[tuple[int, str]] = []  # (status, error text) per request
        self.frontend_rt: Runtime | None = None
        self.rng = random.Random(0)

    async def runtime(self) -> Runtime:
        if self.runtime_config is not None:
            return await self.exit_stack.enter_async_context(open_runtime(self.runtime_config))
        return await self.exit_stack.enter_async_context(
            open_runtime(
                RuntimeConfig(namespace=self.namespace),
                discovery=self.discovery,
                events=self.events,
            )
        )

    async def start_frontend(self, **config: Any) -> None:
        self.frontend_rt = rt = await self.runtime()
        config = {"migration_limit": 3, **config}  # a test may turn migration off
        cfg = FrontendConfig(port=0, request_stats_interval_s=0.2, **config)
        self.base, self.http = await start_frontend_task(self.exit_stack, rt, cfg)

    async def start_planner(
        self,
        config: PlannerConfig,
        engine_factory: Any = mocker_engine,
        connector: Any = None,
        profile: EngineProfile | None = None,
    ) -> PlannerService:
        """`connector(runtime)` builds the connector; default: in-process over `engine_factory`."""
        rt = await self.runtime()
        if connector is None:
            self.connector = InProcessConnector(rt, engine_factory, drain_grace_s=30.0)
        else:
            self.connector = connector(rt)
        self.exit_stack.push_async_callback(self.connector.close)
        self.service = PlannerService(rt, self.connector, config, profile=profile)
        await self.service.start()
        self.exit_stack.push_async_callback(self.service.close)
        stop = asyncio.Event()
        task = asyncio.create_task(self.service.run(stop))

        async def shutdown() -> None:
            stop.set()
            await task

        self.exit_stack.push_async_callback(shutdown)
        return self.service

    async def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Until the frontend lists the model (it saw a worker and loaded its tokenizer): the
        planner counts a worker ready from its own stats, which can come first."""
        assert self.http is not None
        async with asyncio.timeout(timeout_s):
            while True:
                async with self.http.get(f"{self.base}/v1/models") as resp:
                    if resp.status == 200 and MODEL in {
                        m["id"] for m in (await resp.json())["data"]
                    }:
                        return
                await asyncio.sleep(0.05)

    def ready(self, component: str = "backend") -> int:
        assert self.service is not None
        return len(self.service.tracker.registered[component])

    async def request(self, prompt_len: int, max_tokens: int) -> None:
        assert self.http is not None
        prompt = [self.rng.randrange(100, 40000) for _ in range(prompt_len)]  # no prefix hits
        body = {"model": MODEL, "prompt": prompt,
                "max_tokens": max_tokens, "stream": True}  # fmt: skip
        async with self.http.post(f"{self.base}/v1/completions", json=body) as resp:
            text = (await resp.read()).decode()
            failed = resp.status != 200 or '{"error":' in text or "[DONE]" not in text
            self.results.append((resp.status, text[-300:] if failed else ""))

    async def load(self, rate: float, duration_s: float, prompt_len: int, max_tokens: int) -> None:
        """Open loop: `rate` requests per second for `duration_s`, then wait for all."""
        tasks = []
        n = int(rate * duration_s)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(n):
            await asyncio.sleep(max(start + i / rate - loop.time(), 0))
            tasks.append(asyncio.create_task(self.request(prompt_len, max_tokens)))
        await asyncio.gather(*tasks)

    @property
    def failures(self) -> list[tuple[int, str]]:
        return [r for r in self.results if r[1] or r[0] != 200]


def planner_config(**overrides: Any) -> PlannerConfig:
    base = PlannerConfig(
        interval_s=0.2,
        ttft_target_ms=150.0,
        itl_target_ms=40.0,
        cooldown_up_s=0.5,
        cooldown_down_s=1.0,
        scale_down_stable_s=1.0,
        ready_timeout_s=20.0,  # a starved CI host can take seconds to start a mocker
        stats_window_s=3.0,
    )
    return dataclasses.replace(base, **overrides)
