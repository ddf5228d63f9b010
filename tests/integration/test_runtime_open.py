"""Several runtimes in one process sharing memory discovery/events, talking over real TCP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tandem import errors
from tandem.runtime.base import RequestContext
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.lifecycle import drain
from tandem.runtime.runtime import open_runtime

pytestmark = pytest.mark.timeout(15)


async def test_worker_serves_frontend_discovers_and_streams() -> None:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="it")

    async def gen(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        for t in payload.split():
            yield t.upper()

    async with (
        open_runtime(cfg, discovery=disc, events=bus) as worker,
        open_runtime(cfg, discovery=disc, events=bus) as frontend,
    ):
        inst = await worker.serve_endpoint("backend", "generate", gen)
        assert inst.address == worker.server.address and inst.path == "it.backend.generate"
        workers = frontend.instance_set("backend", "generate")
        await workers.start()
        (found,) = (await workers.wait_for(1, timeout_s=2)).values()
        out = [x async for x in frontend.stream(found, b"a b c", request_id="r1")]
        assert out == [b"A", b"B", b"C"]
        sub = await frontend.events.subscribe("it.load.*")
        await worker.events.publish(f"it.load.{inst.instance_id}", b"42")
        assert await asyncio.wait_for(anext(sub), 2) == (f"it.load.{inst.instance_id}", b"42")
        await workers.close()
    assert await disc.list_instances() == []


async def test_drain_unregisters_first_and_finishes_inflight() -> None:
    disc = MemoryDiscovery()
    cfg = RuntimeConfig(namespace="it")
    release = asyncio.Event()

    async def slow(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        yield b"start"
        await release.wait()
        yield b"end"

    async with open_runtime(cfg, discovery=disc) as worker, open_runtime(cfg, discovery=disc) as fe:
        inst = await worker.serve_endpoint("backend", "generate", slow)
        it = fe.stream(inst, b"", request_id="r")
        assert await anext(it) == b"start"
        watch = disc.watch("it.backend")
        assert (await anext(watch)).kind == "added"
        draining = asyncio.create_task(drain(worker, grace_s=5))
        removed = await asyncio.wait_for(anext(watch), 2)
        assert (removed.kind, removed.instance.instance_id) == ("removed", inst.instance_id)
        assert worker.server.num_inflight == 1  # unregistered while the request still runs
        with pytest.raises(errors.PeerGone, match="shutting down"):
            await anext(fe.stream(inst, b"", request_id="late"))
        release.set()
        assert [x async for x in it] == [b"end"]
        await asyncio.wait_for(draining, 5)
        await watch.aclose()
