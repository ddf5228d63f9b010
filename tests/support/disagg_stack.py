"""In-process disaggregated stacks for tests: Workers hosting `DisaggEngine`s over memory
discovery/events and the real TCP request plane, driven through the frontend's streamer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.base import Engine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.config import FrontendConfig
from tandem.frontend.disagg_wiring import disagg_streamer
from tandem.frontend.migration import EngineStreamer
from tandem.protocols.engine import PreprocessedRequest
from tandem.router.config import RouterConfig
from tandem.router.registry import make_router
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import open_runtime


@dataclass
class DisaggStack:
    streamer: Any
    router: Any
    prefill: list[DisaggEngine] = field(default_factory=list)
    decode: list[DisaggEngine] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    async def generate(self, request: PreprocessedRequest) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        reason = None
        async for out in self.streamer.stream(request, self.router):
            tokens += out.token_ids
            reason = out.finish_reason
            if reason is not None:
                break
        return tokens, reason


async def start_stack(
    stack: AsyncExitStack,
    make_engine: Callable[[], Engine],
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    worker: DisaggWorkerConfig | None = None,
    route: DisaggRouteConfig | None = None,
    policy: str = "round_robin",
    migration_limit: int = 0,
    router_config: RouterConfig | None = None,
) -> DisaggStack:
    discovery, events = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="t")
    base = worker or DisaggWorkerConfig(mode="decode")
    out_prefill, out_decode, workers = [], [], []
    for mode, count, into in (("prefill", num_prefill, out_prefill),
                              ("decode", num_decode, out_decode)):  # fmt: skip
        for _ in range(count):
            rt = await stack.enter_async_context(
                open_runtime(cfg, discovery=discovery, events=events)
            )
            wcfg = DisaggWorkerConfig(**{**_fields(base), "mode": mode})
            engine = DisaggEngine(make_engine(), wcfg)
            comp = "prefill" if mode == "prefill" else "backend"
            w = Worker(engine, rt, WorkerConfig(component=comp, metrics_period_s=0.2))
            await w.start()
            stack.push_async_callback(w.stop, 0.0)
            into.append(engine)
            workers.append(w)
    front = await stack.enter_async_context(open_runtime(cfg, discovery=discovery, events=events))
    fcfg = FrontendConfig(
        port=0,
        router_policy=policy,
        router=router_config or RouterConfig(),
        migration_limit=migration_limit,
        disagg=route or DisaggRouteConfig(enabled=True),
    )
    decode_set = front.instance_set("backend", "generate")
    router = make_router(policy, fcfg.router, instances=decode_set, events=front.events,
                         client=front.client, namespace=front.namespace)  # fmt: skip
    aggregated = EngineStreamer(front.client, front.endpoint_path("backend", "generate"),
                                migration_limit=migration_limit)  # fmt: skip
    streamer, pool = disagg_streamer(fcfg, front, aggregated, decode_set)
    await router.start()
    await decode_set.start()
    await pool.start()
    await decode_set.wait_for(num_decode)
    stack.push_async_callback(pool.close)
    stack.push_async_callback(router.close)
    stack.push_async_callback(decode_set.close)
    return DisaggStack(streamer, router, out_prefill, out_decode, workers)


def _fields(config: DisaggWorkerConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}
