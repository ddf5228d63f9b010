"""KV event ingestion end to end in one process: real runtimes (memory discovery and event
bus, TCP request plane), fake mocker-like workers publishing events and serving kv_state."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from router_fake_worker import FakeKvWorker
from tests.support.eventually import eventually

from tandem.router.config import RouterConfig
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import open_runtime

pytestmark = pytest.mark.timeout(30)


def truth(workers: list[FakeKvWorker]) -> dict:
    return {WorkerKey(w.worker_id): {"device": frozenset(w.blocks)} for w in workers if w.blocks}


@contextlib.asynccontextmanager
async def cluster(num_workers: int):
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for i in range(num_workers):
            rt = await stack.enter_async_context(
                open_runtime(RuntimeConfig(), discovery=disc, events=bus)
            )
            w = FakeKvWorker(rt, f"w{i}", seed=i)
            await w.start()
            workers.append(w)
        router_rt = await stack.enter_async_context(
            open_runtime(RuntimeConfig(), discovery=disc, events=bus)
        )

        async def new_router() -> KvRouter:
            insts = router_rt.instance_set("backend", "generate")
            r = make_router(
                "kv",
                RouterConfig(seed=0),
                instances=insts,
                events=bus,
                client=router_rt.client,
                namespace="tandem",
            )
            await r.start()
            stack.push_async_callback(r.close)
            stack.push_async_callback(insts.close)
            await insts.wait_for(num_workers)
            assert isinstance(r, KvRouter)
            return r

        yield workers, new_router


async def test_gap_is_replayed_from_worker_buffer() -> None:
    async with cluster(2) as (workers, new_router):
        r = await new_router()
        await eventually(lambda: r.follower.synced.is_set() and r.applier.synced == {"w0", "w1"})
        for i in range(20):
            await workers[i % 2].step(publish=(i not in (5, 6, 11)))  # three batches lost
        await workers[0].step()
        await workers[1].step()
        await eventually(lambda: r.indexer.snapshot() == truth(workers))
        r.indexer.check_integrity()
        assert any(a is not None for w in workers for a in w.state_requests)  # a replay
        assert r.metrics.events[("batch", "gap")] >= 1


async def test_lost_last_batch_is_replayed_after_a_load_report() -> None:
    """The last batch before a quiet spell is lost: no later batch shows a gap, but the
    worker's load report carries its event id, and the router replays from it."""
    async with cluster(1) as (workers, new_router):
        r = await new_router()
        await eventually(lambda: r.follower.synced.is_set() and r.applier.synced == {"w0"})
        await workers[0].step()
        await workers[0].step(publish=False)  # the tail is lost
        await eventually(lambda: r.applier.last_event_id.get(WorkerKey("w0")) == 1)
        assert r.indexer.snapshot() != truth(workers)

        async def reported() -> bool:  # a worker reports load at least once a second
            await workers[0].report_load()
            await asyncio.sleep(0.1)
            return r.indexer.snapshot() == truth(workers)

        async with asyncio.timeout(10):
            while not await reported():
                pass
        assert workers[0].state_requests[-1] == 1  # a replay after the last applied id
        assert r.metrics.events[("batch", "lost_tail")] == 1


async def test_router_restarted_under_load_converges() -> None:
    async with cluster(3) as (workers, new_router):
        first = await new_router()
        for i in range(30):
            await workers[i % 3].step()
        late = await new_router()  # joins mid-stream: must ask for whole block sets
        for i in range(60):
            await workers[i % 3].step()
            if i % 7 == 0:
                await asyncio.sleep(0)  # interleave with its sync requests
        await eventually(lambda: late.follower.synced.is_set())
        await eventually(
            lambda: first.indexer.snapshot() == truth(workers) == late.indexer.snapshot()
        )
        late.indexer.check_integrity()
        assert all(None in w.state_requests for w in workers)


async def test_worker_leaving_removes_its_blocks() -> None:
    async with cluster(2) as (workers, new_router):
        r = await new_router()
        await eventually(lambda: r.follower.synced.is_set())
        for _ in range(5):
            await workers[1].step()
        await eventually(lambda: r.indexer.snapshot() == truth(workers))
        await workers[1].runtime.unregister_all()
        await eventually(lambda: WorkerKey("w1") not in r.indexer.snapshot())
        assert "w1" not in r.worker_loads()
