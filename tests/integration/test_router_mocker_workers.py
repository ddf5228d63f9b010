"""KvRouter + real Workers hosting MockerEngines, in one process: memory discovery and events,
the TCP request plane. Checks the kv_state contract as the router reads it (see
router_fake_worker.py) against the real Worker, prefix-aware placement, that a router
restarted under load converges to the workers' true block sets, and that the step times
workers publish make a slow worker's prefill cost more."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from tests.support.eventually import eventually
from tests.support.sim_time import SimTime

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.migration import EngineStreamer
from tandem.protocols.engine import PreprocessedRequest, RoutingHints, StopConditions
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

    async def generate(
        self,
        router: KvRouter,
        rid: str,
        tokens: list[int],
        max_tokens: int = 3,
        worker_id: str | None = None,
    ):
        streamer = EngineStreamer(self.runtime.client, f"{NS}.backend.generate")
        request = PreprocessedRequest(
            request_id=rid,
            model="smollm2",
            token_ids=tokens,
            stop=StopConditions(max_tokens=max_tokens),
            routing=RoutingHints(worker_id=worker_id) if worker_id else None,
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
    num_workers: int,
    *,
    num_blocks: int = 64,
    lossy: bool = False,
    speedup_ratios: tuple[float, ...] | None = None,
) -> AsyncIterator[Cluster]:
    """`speedup_ratios`: one per worker, each mocker on its own `SimTime` (default: 0, as
    fast as possible, no step times)."""
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace=NS)
    async with contextlib.AsyncExitStack() as stack:
        workers, engines = [], []
        for i in range(num_workers):
            events = LossyBus(bus, drop_every=3) if lossy and i == 0 else bus
            rt = await stack.enter_async_context(
                open_runtime(cfg, discovery=disc, events=events)  # type: ignore[arg-type]
            )
            ratio = speedup_ratios[i] if speedup_ratios else 0.0
            mocker = MockerConfig(
                num_blocks=num_blocks, block_size=BS, speedup_ratio=ratio, tokenizer=None
            )
            sim = SimTime()
            engine = MockerEngine(mocker, clock=sim.clock, sleep=sim.sleep)
            # a small replay buffer: a late router's gap falls out of it (full dump path);
            # step times (WorkerStats) every 20 ms
            wcfg = WorkerConfig(instance_id=f"w{i}", event_buffer_size=8, stats_period_s=0.02)
            worker = Worker(engine, rt, wcfg)
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


async def test_published_step_times_send_prefill_to_the_faster_worker() -> None:
    """Issue 31, heterogeneous workers: each worker publishes the engine steps it ran
    (WorkerStats on the event plane); the router fits each one's prefill time per token from
    them, so a worker 4x slower (speedup ratio 0.25 against 1) counts its prefill 4x, and
    new prompts go to the fast worker even while the slow one is idle."""
    async with cluster(2, num_blocks=1024, speedup_ratios=(1.0, 0.25)) as c:
        router = await c.new_router()
        fast, slow = (w.instance_id for w in c.workers)
        assert router.speed.slowness([fast, slow]) == {fast: 1.0, slow: 1.0}  # none measured
        for w, worker_id in enumerate((fast, slow)):
            for i, n in enumerate((256, 512, 1024, 384)):  # prefill steps of several sizes
                tokens = [100_000 * (2 * w + 1) + 1000 * i + t for t in range(n)]
                await c.generate(router, f"{worker_id}-{i}", tokens, max_tokens=1,
                                 worker_id=worker_id)  # fmt: skip
        # each worker's last steps arrive with its next WorkerStats: the fits over all four
        # steps of each (the same sizes, each step 4x as long on the slow one) are 4x apart
        await eventually(
            lambda: router.speed.slowness([fast, slow])[slow] == pytest.approx(4.0, rel=1e-6)
        )
        assert router.worker_loads()[slow]["prefill_ms_per_token"] > 0
        prompt_a = [900_000 + t for t in range(BS * 64)]
        prompt_b = [950_000 + t for t in range(BS * 64)]
        explained = router.explain(PreprocessedRequest(
            request_id="x", model="smollm2", token_ids=prompt_a, stop=StopConditions(max_tokens=1)
        ))  # fmt: skip
        slowness = {x["worker_id"]: x["prefill_slowness"] for x in explained["candidates"]}
        assert slowness == {fast: 1.0, slow: pytest.approx(4.0, rel=1e-6)}
        assert explained["choice"] == fast
        # two prompts in flight at once: equal workers would take one each; the fast one
        # prefills both sooner than the slow one prefills one
        routed = [
            await router.route(PreprocessedRequest(
                request_id=rid, model="smollm2", token_ids=p, stop=StopConditions(max_tokens=1)
            ))
            for rid, p in (("a", prompt_a), ("b", prompt_b))
        ]  # fmt: skip
        assert [d.instance_id for d in routed] == [fast, fast]
        for rid in ("a", "b"):
            router.on_finish(rid)
        await router.close()
