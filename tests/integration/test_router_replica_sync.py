"""Two routers (as in two frontends) sharing active-request state over the event plane."""

from __future__ import annotations

from collections import Counter

import pytest
from tests.support.eventually import eventually
from tests.support.instances import backend_instance

from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.config import RouterConfig
from tandem.router.kv_router import KvRouter
from tandem.router.source import StaticInstanceSet
from tandem.runtime.events.memory import MemoryEventBus

pytestmark = pytest.mark.timeout(20)


def req(rid: str, i: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=[10_000 * (i + 1) + t for t in range(64)],
        stop=StopConditions(max_tokens=1),
    )


async def test_two_synced_routers_balance_load() -> None:
    bus = MemoryEventBus()
    card = ModelCard(name="m", context_length=4096, block_size=16, num_total_blocks=1000)
    insts = StaticInstanceSet([backend_instance(i, card, address=f"h:{i}") for i in range(4)])
    a, b = (
        KvRouter(RouterConfig(replica_sync=True, seed=7), instances=insts, events=bus)
        for _ in range(2)
    )
    await a.start()
    await b.start()
    try:
        used_by_a = {(await a.route(req(f"a{i}", i))).instance_id for i in range(3)}
        assert len(used_by_a) == 3
        await eventually(lambda: len(b.active) == 3, poll_s=0.002)
        idle = ({"w0", "w1", "w2", "w3"} - used_by_a).pop()
        assert (await b.route(req("b0", 10))).instance_id == idle
        picks = Counter()
        for i in range(1, 9):  # alternate frontends: load stays even
            router = a if i % 2 else b
            picks[(await router.route(req(f"x{i}", 20 + i))).instance_id] += 1
            await eventually(lambda: len(a.active) == len(b.active), poll_s=0.002)
        assert sorted(picks.values()) == [2, 2, 2, 2]
        for i in range(3):
            a.on_finish(f"a{i}")
        await eventually(lambda: len(b.active) == 9)  # 12 routed, 3 finished
        b.active.check_integrity()
    finally:
        await a.close()
        await b.close()


async def test_a_replica_that_restarts_catches_up_on_active_requests() -> None:
    bus = MemoryEventBus()
    card = ModelCard(name="m", context_length=4096, block_size=16, num_total_blocks=1000)
    insts = StaticInstanceSet([backend_instance(i, card, address=f"h:{i}") for i in range(4)])

    def router() -> KvRouter:
        return KvRouter(RouterConfig(replica_sync=True, seed=7), instances=insts, events=bus)

    a, b = router(), router()
    await a.start()
    await b.start()
    b2 = None
    try:
        for i in range(3):
            await a.route(req(f"a{i}", i))
        a.on_first_token("a0")
        await eventually(lambda: len(b.active) == 3, poll_s=0.002)
        await b.close()  # b restarts: a new router with an empty view
        b2 = router()
        await b2.start()
        await eventually(lambda: len(b2.active) == 3, poll_s=0.002)
        for i in range(4):
            assert b2.active.num_requests(f"w{i}") == a.active.num_requests(f"w{i}")
            assert b2.active.num_prefill_tokens(f"w{i}") == a.active.num_prefill_tokens(f"w{i}")
        b2.active.check_integrity()
        assert len(a.active) == 3  # a's own view is unchanged by the hello
    finally:
        await a.close()
        if b2 is not None:
            await b2.close()
