"""KvRouter + real Workers hosting MockerEngines with simulated kvbm tiers: the Worker
publishes host-tier KV events like device ones, the router's index holds them per medium, and
a conversation evicted from every device pool goes back to the worker that kept it in host
memory (partial credit, DESIGN.md §7), where it is onboarded instead of recomputed."""

from __future__ import annotations

import contextlib
import random

import pytest
from tests.support.eventually import eventually

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.migration import EngineStreamer
from tandem.kvbm.base import KvbmConfig
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, StopConditions
from tandem.router.config import RouterConfig
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import open_runtime
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(30)
BS = 4
NS = "t"


async def test_router_credits_host_tier_and_the_worker_onboards() -> None:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace=NS)
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for i in range(2):
            rt = await stack.enter_async_context(open_runtime(cfg, discovery=disc, events=bus))
            tiers = KvbmConfig(host_blocks=256, log_interval_s=0)
            engine = MockerEngine(
                MockerConfig(num_blocks=16, block_size=BS, speedup_ratio=0, tokenizer=None,
                             kvbm=tiers)
            )  # fmt: skip
            worker = Worker(engine, rt, WorkerConfig(instance_id=f"w{i}"))
            await worker.start()
            stack.push_async_callback(worker.stop, 0)
            workers.append(worker)
        router_rt = await stack.enter_async_context(open_runtime(cfg, discovery=disc, events=bus))
        insts = router_rt.instance_set("backend", "generate")
        stack.push_async_callback(insts.close)
        router = make_router(
            "kv", RouterConfig(seed=0), instances=insts, events=router_rt.events,
            client=router_rt.client, namespace=NS,
        )  # fmt: skip
        assert isinstance(router, KvRouter)
        await router.start()
        stack.push_async_callback(router.close)
        await insts.wait_for(2)
        streamer = EngineStreamer(router_rt.client, f"{NS}.backend.generate")

        async def generate(rid: str, tokens: list[int]) -> list[EngineOutput]:
            req = PreprocessedRequest(request_id=rid, model="smollm2", token_ids=tokens,
                                      stop=StopConditions(max_tokens=2))  # fmt: skip
            return [o async for o in streamer.stream(req, router)]

        rng = random.Random(5)
        conv = [rng.randrange(20, 5000) for _ in range(32)]  # 8 blocks
        await generate("a1", conv)
        holder = router.metrics.routed.most_common(1)[0][0]
        other = "w1" if holder == "w0" else "w0"
        hashes = sequence_hashes(conv, BS)
        key = WorkerKey(holder)
        for i in range(16):  # unrelated traffic churns both 16-block device pools
            await generate(f"f{i}", [rng.randrange(20, 5000) for _ in range(40)])
        await eventually(
            lambda: (
                not any(router.indexer.holds(key, h) for h in hashes)
                and all(router.indexer.holds(key, h, "host") for h in hashes)
            )
        )
        explained = router.explain(
            PreprocessedRequest(
                request_id="x",
                model="smollm2",
                token_ids=[*conv, 1, 2],
                stop=StopConditions(max_tokens=2),
            )
        )
        overlaps = {c["worker_id"]: c["overlap_blocks"] for c in explained["candidates"]}
        # the router's default host credit (0.5) for each of the 8 blocks; none elsewhere
        assert overlaps.get(holder) == pytest.approx(0.5 * 8) and not overlaps.get(other)
        before = router.metrics.routed[holder]
        outs = await generate("a2", [*conv, 1, 2])
        assert router.metrics.routed[holder] == before + 1
        assert outs[0].num_cached_tokens == 32  # onboarded from the holder's host tier
