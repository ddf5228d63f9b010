"""The `tandem router` service and `--router remote` frontends, in one process: real Workers
with MockerEngines, memory discovery/events, the TCP request plane (and, for the CLI wiring,
file discovery + ZMQ events)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from tests.support.eventually import eventually

from tandem.cli import router as router_cli
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.errors import NoWorkersAvailable, Overloaded
from tandem.frontend.config import FrontendConfig
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.serve import serve_frontend
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.tenancy import DEFAULT_TENANT
from tandem.router.config import RouterConfig
from tandem.router.kv_router import KvRouter
from tandem.router.queue import OUTPUT_TOKEN_WEIGHT
from tandem.router.registry import make_router
from tandem.router.remote import RemoteRouter
from tandem.router.service import RouterService
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime

pytestmark = pytest.mark.timeout(30)
BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 3) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="smollm2",
        token_ids=tokens,
        stop=StopConditions(max_tokens=max_tokens),
    )


@dataclass
class Cluster:
    runtimes: list[Runtime]  # one per frontend
    service: RouterService | None
    stack: contextlib.AsyncExitStack
    discovery: MemoryDiscovery

    async def remote(self, frontend: int = 0) -> RemoteRouter:
        rt = self.runtimes[frontend]
        router = make_router(
            "remote", RouterConfig(), instances=None, client=rt.client, discovery=rt.discovery
        )
        assert isinstance(router, RemoteRouter)
        await router.start()
        self.stack.push_async_callback(router.close)
        return router

    async def generate(self, router: RemoteRouter, request: PreprocessedRequest, frontend: int = 0):
        streamer = EngineStreamer(self.runtimes[frontend].client, "tandem.backend.generate")
        return [o async for o in streamer.stream(request, router)]


@contextlib.asynccontextmanager
async def cluster(
    num_workers: int = 3, *, with_service: bool = True, **router_config: object
) -> AsyncIterator[Cluster]:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig()
    async with contextlib.AsyncExitStack() as stack:
        for i in range(num_workers):
            rt = await stack.enter_async_context(open_runtime(cfg, discovery=disc, events=bus))
            engine = MockerEngine(
                MockerConfig(num_blocks=512, block_size=BS, speedup_ratio=0, tokenizer=None)
            )
            worker = Worker(engine, rt, WorkerConfig(instance_id=f"w{i}"))
            await worker.start()
            stack.push_async_callback(worker.stop, 0)
        service = None
        if with_service:
            service_rt = await stack.enter_async_context(
                open_runtime(cfg, discovery=disc, events=bus)
            )
            service = RouterService(service_rt, "kv", RouterConfig(seed=0, **router_config))  # type: ignore[arg-type]
            await service.start()
            stack.push_async_callback(service.close)
            await service.workers.wait_for(num_workers)
        runtimes = [
            await stack.enter_async_context(open_runtime(cfg, discovery=disc, events=bus))
            for _ in range(2)
        ]
        yield Cluster(runtimes, service, stack, disc)


async def test_two_frontends_share_the_service_view_of_caches_and_load() -> None:
    async with cluster() as c:
        assert c.service is not None
        kv = c.service.router
        assert isinstance(kv, KvRouter)
        a, b = await c.remote(0), await c.remote(1)
        await eventually(lambda: len(a.services.instances) == len(b.services.instances) == 1)
        prefix = [5] * (BS * 12)
        await c.generate(a, req("a0", [*prefix, 1]), frontend=0)
        holder = kv.metrics.routed.most_common(1)[0][0]
        await eventually(lambda: kv.indexer.num_blocks(next(iter(kv.indexer.workers))) > 0)
        rng = random.Random(0)
        for i in range(4):  # the other frontend's requests find the same cached prefix
            tokens = [*prefix, *(rng.randrange(100, 200) for _ in range(3))]
            outs = await c.generate(b, req(f"b{i}", tokens), frontend=1)
            assert outs[-1].finish_reason == "length"
        assert kv.metrics.routed[holder] == 5
        assert kv.metrics.overlap_blocks == 4 * 12  # every later request hit the whole prefix
        # first_token and free notices reached the service: nothing stays active
        await eventually(lambda: len(kv.active) == 0)


async def test_notices_settle_prefill_then_free() -> None:
    async with cluster() as c:
        kv = c.service.router  # type: ignore[union-attr]
        remote = await c.remote()
        await eventually(lambda: len(remote.services.instances) == 1)
        decision = await remote.route(req("r1", list(range(BS * 10)), max_tokens=300))
        assert len(kv.active) == 1
        charged = kv.queue.served_tokens[DEFAULT_TENANT]  # its fair-share charge: 300 expected
        assert kv.active.num_prefill_tokens(decision.instance_id) == BS * 10
        remote.on_first_token("r1")
        await eventually(lambda: kv.active.num_prefill_tokens(decision.instance_id) == 0)
        assert len(kv.active) == 1
        remote.on_finish("r1", 7)  # it generated 7: the service settles the charge by them
        remote.on_finish("r1", 7)  # idempotent: sent once
        await eventually(lambda: len(kv.active) == 0)
        kv.active.check_integrity()
        settled = charged - (300 - 7) * OUTPUT_TOKEN_WEIGHT
        assert kv.queue.served_tokens[DEFAULT_TENANT] == pytest.approx(settled)


async def test_service_errors_reach_the_frontend_typed() -> None:
    async with cluster(1, busy_prefill_tokens=8) as c:
        remote = await c.remote()
        await eventually(lambda: len(remote.services.instances) == 1)
        await remote.route(req("big", list(range(BS * 4))))  # 16 prefill tokens: now busy
        with pytest.raises(Overloaded) as info:
            await remote.route(req("next", list(range(BS))))
        assert info.value.retry_after_s == RouterConfig().retry_after_s


async def test_no_service_is_a_clear_error() -> None:
    async with cluster(1, with_service=False) as c:
        remote = await c.remote()
        with pytest.raises(NoWorkersAvailable, match="tandem router"):
            await remote.route(req("r", [1, 2, 3]))


async def test_http_frontend_with_router_remote() -> None:
    async with cluster(2) as c:
        ready, stop, bound = asyncio.Event(), asyncio.Event(), []
        config = FrontendConfig(port=0, router_policy="remote")
        task = asyncio.create_task(
            serve_frontend(config, c.runtimes[0], ready=ready, stop=stop, bound=bound)
        )
        try:
            await asyncio.wait_for(ready.wait(), 10)
            host, port = bound[0]
            body = {"model": "smollm2", "prompt": list(range(100, 140)), "max_tokens": 4}
            async with aiohttp.ClientSession() as http:
                for _ in range(2):
                    async with http.post(f"http://{host}:{port}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        usage = (await r.json())["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 32  # the same worker again
            assert sum(c.service.router.metrics.routed.values()) == 2  # type: ignore[union-attr]
        finally:
            stop.set()
            await task


async def test_router_cli_serves_over_file_discovery_and_zmq(tmp_path) -> None:
    cfg = RuntimeConfig(discovery="file", discovery_dir=str(tmp_path), events="zmq")
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    args = parser.parse_args(["--discovery", "file", "--discovery-dir", str(tmp_path)])
    args.runtime_events = "zmq"
    assert args.router == "kv"
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        worker_rt = await stack.enter_async_context(open_runtime(cfg))
        engine = MockerEngine(MockerConfig(block_size=BS, speedup_ratio=0, tokenizer=None))
        worker = Worker(engine, worker_rt, WorkerConfig(instance_id="w0"))
        await worker.start()
        stack.push_async_callback(worker.stop, 0)
        service = asyncio.create_task(router_cli.serve(args, stop))
        front_rt = await stack.enter_async_context(open_runtime(cfg))
        remote = make_router(
            "remote",
            RouterConfig(),
            client=front_rt.client,
            discovery=front_rt.discovery,
            instances=None,
        )
        await remote.start()
        try:
            async with asyncio.timeout(10):
                while True:  # the service registers, then discovers the worker
                    with contextlib.suppress(NoWorkersAvailable):
                        decision = await remote.route(req("r", [1, 2, 3, 4, 5]))
                        break
                    await asyncio.sleep(0.05)
            assert decision.instance_id == "w0"
        finally:
            await remote.close()
            stop.set()
            await service


async def test_router_system_port_binds_the_request_planes_address(tmp_path) -> None:
    """`--system-host` defaults to the runtime's bind address (a router on another host than
    etcd/NATS serves /metrics and /health where others can reach it), not to loopback."""
    from tests.support.services import free_port

    port = free_port()
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    flags = ["--discovery", "file", "--discovery-dir", str(tmp_path), "--host", "127.0.0.5"]
    args = parser.parse_args([*flags, "--system-port", str(port), "--router", "round_robin"])
    stop = asyncio.Event()
    service = asyncio.create_task(router_cli.serve(args, stop))
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(10):
            while True:  # the service starts its system server once registered
                with contextlib.suppress(aiohttp.ClientConnectorError):
                    async with http.get(f"http://127.0.0.5:{port}/live") as resp:
                        assert resp.status == 200
                        break
                await asyncio.sleep(0.05)
            with pytest.raises(aiohttp.ClientConnectorError):  # nothing on 127.0.0.1
                await http.get(f"http://127.0.0.1:{port}/live")
    finally:
        stop.set()
        await service
