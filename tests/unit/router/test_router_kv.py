from __future__ import annotations

from collections import Counter

import pytest
from tests.support.instances import backend_instance

from tandem.errors import Overloaded
from tandem.protocols.discovery import Instance, ModelCard
from tandem.protocols.engine import PreprocessedRequest, RoutingHints, StopConditions
from tandem.router.config import RouterConfig
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(10)
B = 4


def inst(i: int, blocks: int = 1000) -> Instance:
    card = ModelCard(name="m", context_length=4096, block_size=B, num_total_blocks=blocks)
    return backend_instance(i, card)


def req(rid: str, tokens: list[int], **hints: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=tokens,
        stop=StopConditions(max_tokens=4),
        routing=RoutingHints(**hints) if hints else None,
    )  # type: ignore[arg-type]


def kv(n: int = 4, **cfg: object) -> KvRouter:
    r = make_router(
        "kv",
        RouterConfig(seed=0, **cfg),  # type: ignore[arg-type]
        instances=StaticInstanceSet([inst(i) for i in range(n)]),
    )
    assert isinstance(r, KvRouter)
    return r


PROMPT = list(range(64))  # 16 blocks


async def test_routes_to_worker_holding_prefix_and_reports_overlap() -> None:
    r = kv()
    r.indexer.store(WorkerKey("w2"), sequence_hashes(PROMPT[:40], B))
    d = await r.route(req("a", PROMPT))
    assert (d.instance_id, d.overlap_blocks, d.request_blocks) == ("w2", 10, 16)
    ex = r.explain(req("b", PROMPT))
    rows = {c["worker_id"]: c for c in ex["candidates"]}
    # 10 blocks cached, all 16 in flight there (request a): cached-to-be
    assert rows["w2"]["overlap_blocks"] == 16 and rows["w0"]["overlap_blocks"] == 0
    assert ex["choice"] == min(rows, key=lambda w: rows[w]["cost"])
    assert "w2" not in (await r.route(req("c", PROMPT), exclude=frozenset({"w2"}))).instance_id


async def test_unrelated_requests_spread_by_active_load() -> None:
    r = kv()
    picks = Counter()
    for i in range(8):
        tokens = [1000 * (i + 1) + t for t in range(32)]
        picks[(await r.route(req(str(i), tokens))).instance_id] += 1
    assert picks == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}
    r.active.check_integrity()


async def test_first_token_and_finish_release_load() -> None:
    r = kv(2)
    d = await r.route(req("a", PROMPT))
    assert r.active.num_prefill_tokens(d.instance_id) == 64
    r.on_first_token("a")
    assert r.active.num_prefill_tokens(d.instance_id) == 0
    assert r.active.num_active_blocks(d.instance_id) == 16
    r.on_finish("a")
    assert r.active.num_active_blocks(d.instance_id) == 0
    r.active.check_integrity()


async def test_per_request_overlap_weight_override() -> None:
    r = kv(2)
    r.indexer.store(WorkerKey("w1"), sequence_hashes(PROMPT, B))
    for i in range(3):  # pile load onto w1 (it holds the prefix)
        r.active.add(f"x{i}", "w1", list(range(100 * i, 100 * i + 20)), 0)
    # weight 0: only decode load counts -> w0; large weight: prefill savings win -> w1
    assert (await r.route(req("a", PROMPT, overlap_weight=0.0))).instance_id == "w0"
    assert (await r.route(req("b", PROMPT, overlap_weight=50.0))).instance_id == "w1"


async def test_default_weight_keeps_a_long_prefix_on_its_decoding_holder() -> None:
    """A long cached prefix beats one decoding request of the same length on its holder:
    the default weight values the avoided prefill over the holder's extra active blocks."""
    long_prompt = list(range(400))  # 100 blocks
    r = kv(2)
    r.indexer.store(WorkerKey("w1"), sequence_hashes(long_prompt[:360], B))
    r.active.add("decoding", "w1", list(range(10_000, 10_100)), 0)  # prefilled, 100 blocks
    assert (await r.route(req("a", long_prompt))).instance_id == "w1"
    r.on_finish("a")
    assert (await r.route(req("b", long_prompt, overlap_weight=1.0))).instance_id == "w0"


async def test_busy_workers_skipped_then_overloaded_with_retry_after() -> None:
    r = kv(2, busy_prefill_tokens=50, retry_after_s=2.5)
    assert (await r.route(req("a", PROMPT))).instance_id in ("w0", "w1")
    second = (await r.route(req("b", PROMPT))).instance_id
    assert second != r.active.worker_of("a")
    with pytest.raises(Overloaded) as exc:
        await r.route(req("c", PROMPT))
    assert exc.value.retry_after_s == 2.5
    assert r.explain(req("d", PROMPT))["all_busy"] is True
    r.on_first_token("a")
    assert (await r.route(req("c", PROMPT))).instance_id == r.active.worker_of("a")


async def test_worker_leaving_drops_its_blocks_and_metrics_render() -> None:
    insts = StaticInstanceSet([inst(0), inst(1)])
    r = KvRouter(RouterConfig(seed=0), instances=insts)
    await r.start()
    r.indexer.store(WorkerKey("w1"), sequence_hashes(PROMPT, B))
    await r.route(req("a", PROMPT))
    insts.remove("w1")
    assert r.indexer.find_matches(sequence_hashes(PROMPT, B)) == {}
    text = r.metrics_text()
    assert 'tandem_router_routed_requests_total{worker_id="w1"} 1' in text
    assert "tandem_router_kv_hit_rate 1\n" in text
    assert "tandem_router_overhead_seconds_count 1" in text
    await r.close()


async def test_images_route_to_the_worker_holding_that_image_only() -> None:
    from tandem.protocols.engine import MmItem

    r = kv()
    prompt = [7, 8, 9, 10] + [16] * 12 + list(range(20, 36))  # image rows 4..15
    cat, dog = (
        MmItem(mm_hash=11, offset=4, num_tokens=12),
        MmItem(mm_hash=22, offset=4, num_tokens=12),
    )
    r.indexer.store(WorkerKey("w1"), sequence_hashes(prompt, B, mm_items=[cat]))
    r.indexer.store(WorkerKey("w3"), sequence_hashes(prompt, B, mm_items=[dog]))
    with_cat, with_dog = req("a", prompt), req("b", prompt)
    with_cat.mm_items, with_dog.mm_items = [cat], [dog]
    assert (await r.route(with_cat)).instance_id == "w1"
    d = await r.route(with_dog)
    assert (d.instance_id, d.overlap_blocks) == ("w3", 8)
