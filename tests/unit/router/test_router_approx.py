from __future__ import annotations

import pytest
from tests.support.instances import backend_instance

from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.approx import ApproxCache
from tandem.router.config import RouterConfig
from tandem.router.indexer import KvIndexer, WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.source import StaticInstanceSet

pytestmark = pytest.mark.timeout(10)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ttl_refresh_and_cap_pruning() -> None:
    clock, idx = Clock(), KvIndexer()
    cache = ApproxCache(idx, ttl_s=10, max_blocks=4, clock=clock)
    cache.record("w", [1, 2, 3])
    clock.now = 6
    cache.record("w", [1, 2])  # refreshed: expire at 16
    clock.now = 11
    assert cache.expire() == 1  # block 3 only
    assert idx.find_matches([1, 2, 3]) == {WorkerKey("w"): 2}
    cache.record("w", [5, 6, 7])  # 5 blocks > cap 4: the oldest (1) pruned
    assert cache.num_pruned == 1
    assert not idx.holds(WorkerKey("w"), 1) and idx.holds(WorkerKey("w"), 2)
    idx.check_integrity()


async def test_no_kv_events_router_learns_from_its_own_decisions() -> None:
    clock = Clock()
    card = ModelCard(name="m", context_length=4096, block_size=4, num_total_blocks=100)
    insts = StaticInstanceSet([backend_instance(i, card, address=f"h:{i}") for i in range(4)])
    r = KvRouter(
        RouterConfig(use_kv_events=False, approx_ttl_s=120, seed=3), instances=insts, clock=clock
    )

    def req(rid: str) -> PreprocessedRequest:
        return PreprocessedRequest(
            request_id=rid, model="m", token_ids=list(range(64)), stop=StopConditions(max_tokens=1)
        )

    first = await r.route(req("a"))
    r.on_finish("a")
    again = await r.route(req("b"))
    assert again.instance_id == first.instance_id and again.overlap_blocks == 16
    r.on_finish("b")
    clock.now = 200  # past the TTL: the prediction is gone
    assert (await r.route(req("c"))).overlap_blocks == 0
