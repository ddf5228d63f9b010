"""KvRouter + real Workers hosting MockerEngines, in one process: memory discovery and events,
the TCP request plane. Checks the kv_state contract as the router reads it (see
router_fake_worker.py) against the real Worker, prefix-aware placement, and that a router
restarted under load converges to the workers' true block sets."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from tests.support.eventually import eventually

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.migration import EngineStreamer
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.kv_events import BlockStored
from tandem.router.config import RouterConfig
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime

pytestmark = pytest.mark.timeout(30)
BS = 4
NS = "t"


@dataclass
class Cluster:
    workers: list[Worker]
    engines: list[MockerEngine]
    runtime: Runtime  # the router's
    stack: contextlib.AsyncExitStack

    def truth(self) -> dict[WorkerKey, dict[str, frozenset[int]]]:
        """Each engine's cached blocks, read from its own pool."""
        out = {}
        for w, e in zip(self.workers, self.engines, strict=True):
            hashes = {
                h for ev in e.kv_snapshot() if isinstance(ev, BlockStored) for h in ev.block_hashes
            }
            if hashes:
                out[WorkerKey(w.instance_id)] = {"device": frozenset(hashes)}
        return out

    async def new_router(self, **overrides: object) -> KvRouter:
        insts = self.runtime.instance_set("backend", "generate")
        router = make_router(
            "kv",
            RouterConfig(seed=0, **overrides),  # type: ignore[arg-type]
            instances=insts,
            events=self.runtime.events,
            client=self.runtime.client,
            namespace=NS,
        )
        assert isinstance(router, KvRouter)
        await router.start()
        await insts.wait_for(len(self.workers))
        self.stack.push_async_callback(insts.close)
        return router

    async def generate(self, router: KvRouter, rid: str, tokens: list[int], max_tokens: int = 3):
        streamer = EngineStreamer(self.runtime.client, f"{NS}.backend.generate")
        request = PreprocessedRequest(
            request_id=rid,
            model="smollm2",
            token_ids=tokens,
            stop=StopConditions(max_tokens=max_tokens),
        )
        outs = [o async for o in streamer.stream(request, router)]
        assert outs[-1].finish_reason == "length"
        return outs


class LossyBus:
    """The shared memory bus, except that every `drop_every`-th KV event batch is lost."""

    def __init__(self, bus: MemoryEventBus, drop_every: int) -> None:
        self.bus, self.drop_every, self.num_kv, self.num_dropped = bus, drop_every, 0, 0

    async def publish(self, subject: str, payload: bytes) -> None:
        if subject.endswith(".kv_events"):
            self.num_kv += 1
            if self.num_kv % self.drop_every == 0:
                self.num_dropped += 1
                return
        await self.bus.publish(subject, payload)

    async def subscribe(self, subject: str):  # type: ignore[no-untyped-def]
        return await self.bus.subscribe(subject)

    async def close(self) -> None:
        pass


@contextlib.asynccontextmanager
async def cluster(
    num_workers: int, *, num_blocks: int = 64, lossy: bool = False
) -> AsyncIterator[Cluster]:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace=NS)
    async with contextlib.AsyncExitStack() as stack:
        workers, engines = [], []
        for i in range(num_workers):
            events = LossyBus(bus, drop_every=3) if lossy and i == 0 else bus
            rt = await stack.enter_async_context(
                open_runtime(cfg, discovery=disc, events=events)  # type: ignore[arg-type]
            )
            engine = MockerEngine(
                MockerConfig(num_blocks=num_blocks, block_size=BS, speedup_ratio=0, tokenizer=None)
            )
            # a small replay buffer: a late router's gap falls out of it (full dump path)
            worker = Worker(engine, rt, WorkerConfig(instance_id=f"w{i}", event_buffer_size=8))
            await worker.start()
            stack.push_async_callback(worker.stop, 0)
            workers.append(worker)
            engines.append(engine)
        router_rt = await stack.enter_async_context(open_runtime(cfg, discovery=disc, events=bus))
        yield Cluster(workers, engines, router_rt, stack)


def prompt(rng: random.Random, group: int, num_blocks: int) -> list[int]:
    """A prompt of `num_blocks` full blocks plus a tail: group-shared head, random rest."""
    head = [group * 100 + t for t in range(BS * 3)]
    rest = [rng.randrange(10_000, 20_000) for _ in range(BS * (num_blocks - 3) + 2)]
    return head + rest


async def test_real_worker_kv_state_feeds_the_router_index() -> None:
    async with cluster(3) as c:
        # traffic before the router exists: it must learn it through kv_state full dumps
        seed_router = await c.new_router()
        rng = random.Random(1)
        for i in range(12):
            await c.generate(seed_router, f"pre{i}", prompt(rng, i % 4, 6))
        await seed_router.close()
        router = await c.new_router()
        await eventually(lambda: router.follower.synced.is_set())
        await eventually(lambda: router.indexer.snapshot() == c.truth())
        router.indexer.check_integrity()
        assert router.metrics.events[("full_state", "applied")] >= 3
        await router.close()


async def test_lost_batches_are_replayed_from_the_real_worker() -> None:
    async with cluster(2, num_blocks=512, lossy=True) as c:
        router = await c.new_router()
        await eventually(lambda: router.follower.synced.is_set())
        rng = random.Random(4)
        for i in range(20):
            await c.generate(router, f"g{i}", prompt(rng, i % 3, 5), max_tokens=1)
        lossy = c.workers[0].runtime.events
        assert lossy.num_dropped >= 1
        await c.generate(router, "last", prompt(rng, 0, 5), max_tokens=1)
        await eventually(lambda: router.indexer.snapshot() == c.truth())
        assert router.metrics.events[("batch", "gap")] >= 1
        assert router.metrics.events[("replay", "applied")] >= 1
        assert router.metrics.events[("full_state", "applied")] == 2  # one per worker at start
        await router.close()


async def test_shared_prefix_requests_follow_the_cached_worker() -> None:
    async with cluster(4, num_blocks=512) as c:
        router = await c.new_router()
        rng = random.Random(2)
        long_prefix = [7] * (BS * 20)
        await c.generate(router, "warm", [*long_prefix, 1, 2])
        holder = router.metrics.routed.most_common(1)[0][0]
        await eventually(lambda: WorkerKey(holder) in router.indexer.snapshot())
        for i in range(8):
            suffix = [rng.randrange(30_000, 40_000) for _ in range(BS)]
            await c.generate(router, f"s{i}", long_prefix + suffix)
        assert router.metrics.routed[holder] == 9
        assert router.metrics.hit_rate > 0.8
        await router.close()


async def test_restarted_router_under_load_converges() -> None:
    async with cluster(3) as c:
        first = await c.new_router()
        stop = asyncio.Event()
        rng = random.Random(3)
        counter = iter(range(1_000_000))

        async def load(router_box: list[KvRouter]) -> None:
            while not stop.is_set():
                n = next(counter)
                # many groups and a small pool: blocks are stored and evicted all the time
                await c.generate(router_box[0], f"r{n}", prompt(rng, n % 9, rng.randint(4, 9)))

        box = [first]
        async with asyncio.TaskGroup() as tg:
            for _ in range(4):
                tg.create_task(load(box))
            await eventually(lambda: sum(first.metrics.routed.values()) >= 30)
            box[0] = second = await c.new_router()  # takes over while requests are in flight
            await first.close()
            await eventually(lambda: sum(second.metrics.routed.values()) >= 40)
            stop.set()
        await eventually(lambda: second.follower.synced.is_set())
        await eventually(lambda: second.indexer.snapshot() == c.truth())
        second.indexer.check_integrity()
        removed = second.metrics.events[("removed", "applied")]
        assert removed > 0, "the small pools must evict, or removals went untested"
        await second.close()
