"""Peer KV fetch in the KV router: the pure plan (bytes / bandwidth against recomputing),
its credit in the cost, and the router sending a hint only when the fetch pays."""

from __future__ import annotations

import msgspec
import pytest
from tests.support.instances import backend_instance

from tandem.protocols.discovery import Instance, ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.kv_events import LoadMetrics
from tandem.router.config import RouterConfig
from tandem.router.cost import candidate_cost
from tandem.router.fetch import plan_fetch
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(10)
B = 16
PROMPT = list(range(1024))  # 64 blocks
KV_BYTES = 131072  # per token (an 8B model's fp16 KV)


def plan(local: int, holder: int, gbps: float, prefill_us: float = 50.0):
    return plan_fetch(
        source_id="w0", local_blocks=local, holder_blocks=holder, block_size=B,
        bytes_per_token=KV_BYTES, bandwidth_bytes_per_s=gbps * 1e9,
        prefill_s_per_token=prefill_us * 1e-6, setup_s=0.002,
    )  # fmt: skip


def test_fetch_pays_only_when_moving_bytes_beats_recomputing() -> None:
    fast = plan(0, 60, gbps=50.0)  # 126 MB in 2.5 ms + 2 ms vs 960 tokens x 50 us = 48 ms
    assert fast is not None and fast.pays
    assert fast.num_bytes == 60 * B * KV_BYTES
    assert fast.fetch_ms == pytest.approx(2.0 + fast.num_bytes / 50e9 * 1e3)
    assert fast.recompute_ms == pytest.approx(60 * B * 50e-3)
    assert 0 < fast.credit_blocks < 60
    slow = plan(0, 60, gbps=1.0)  # 126 ms of transfer > 48 ms of prefill
    assert slow is not None and not slow.pays and slow.credit_blocks == 0
    # the candidate already holds most of it: only the 4 blocks after its own move
    tail = plan(56, 60, gbps=50.0)
    assert tail is not None and tail.pays
    assert (tail.first_block, tail.num_blocks) == (56, 4)
    assert tail.num_bytes == 4 * B * KV_BYTES
    assert tail.recompute_ms == pytest.approx(4 * B * 50e-3)
    # one block saved (0.8 ms of prefill) does not pay the 2 ms setup
    assert not plan(59, 60, gbps=50.0).pays  # type: ignore[union-attr]
    assert plan(60, 60, gbps=50.0) is None and plan(0, 0, gbps=50.0) is None


def test_cost_credits_a_paying_fetch_and_drops_one_that_does_not() -> None:
    base = dict(worker_id="w1", num_tokens=1024, block_size=B, overlap_blocks=0.0,
                active_prefill_tokens=0, active_blocks=0, num_new_blocks=64,
                overlap_weight=4.0)  # fmt: skip
    plain = candidate_cost(**base)  # type: ignore[arg-type]
    fast, slow = plan(0, 60, gbps=50.0), plan(0, 60, gbps=1.0)
    with_fetch = candidate_cost(**base, fetch=fast)  # type: ignore[arg-type]
    assert with_fetch.fetch == fast and fast is not None
    assert with_fetch.overlap_blocks == pytest.approx(fast.credit_blocks)
    assert with_fetch.cost < plain.cost
    dropped = candidate_cost(**base, fetch=slow)  # type: ignore[arg-type]
    assert dropped.fetch is None and dropped.cost == plain.cost


def instance(i: int, gbps: float) -> Instance:
    card = ModelCard(name="m", context_length=8192, block_size=B, num_total_blocks=4096)
    inst = backend_instance(i, card)
    meta = {"kv_fetch": {"address": ["127.0.0.1", 7000 + i], "agent_id": f"agent{i}",
                         "bytes_per_token": KV_BYTES, "bandwidth_bytes_per_s": gbps * 1e9,
                         "prefill_s_per_token": 50e-6}}  # fmt: skip
    return msgspec.structs.replace(inst, metadata=meta)


def router(gbps: float, **cfg: object) -> KvRouter:
    r = make_router(
        "kv",
        RouterConfig(seed=0, **cfg),  # type: ignore[arg-type]
        instances=StaticInstanceSet([instance(0, gbps), instance(1, gbps)]),
    )
    assert isinstance(r, KvRouter)
    r.indexer.store(WorkerKey("w0"), sequence_hashes(PROMPT, B))  # w0 holds the whole prompt
    for i in range(6):  # and is busy prefilling others
        r.active.add(f"x{i}", "w0", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 64)), 1024)
    return r


def req(rid: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=PROMPT, stop=StopConditions(max_tokens=4)
    )


async def test_router_sends_the_idle_worker_a_hint_to_fetch_from_the_busy_holder() -> None:
    r = router(gbps=50.0)
    explained = r.explain(req("e"))
    assert explained["choice"] == "w1"
    assert explained["kv_fetch"]["source_id"] == "w0"
    assert explained["kv_fetch"]["fetch_ms"] < explained["kv_fetch"]["recompute_ms"]
    d = await r.route(req("a"))
    assert d.instance_id == "w1" and d.kv_fetch is not None
    assert d.kv_fetch.source_instance_id == "w0" and d.kv_fetch.agent_id == "agent0"
    assert d.kv_fetch.address == ("127.0.0.1", 7000)
    # the last token is computed by the fetcher, but hashes of every cached full block go
    assert d.kv_fetch.block_hashes == sequence_hashes(PROMPT, B)
    assert d.details["kv_fetch"] == {"source": "w0", "blocks": 64}
    assert r.metrics.kv_fetches == 1 and r.metrics.kv_fetch_blocks == 64
    assert "tandem_router_kv_fetches_total 1\n" in r.metrics.render()
    row = r.decisions.snapshot(1)[0]  # what /dashboard shows
    assert row["kv_fetch"] == {"source": "w0", "blocks": 64}
    chosen = next(c for c in row["candidates"] if c["worker_id"] == "w1")
    assert chosen["fetch"]["source_id"] == "w0" and chosen["fetch"]["num_blocks"] == 64


async def test_measured_bandwidth_overrides_the_declared_one() -> None:
    """w1's fetches measured 50 GB/s (published with its load): that, not the declared
    0.5 GB/s, prices its fetch."""
    r = router(gbps=0.5)
    assert r.explain(req("e"))["kv_fetch"] is None
    load = LoadMetrics(worker_id="w1", num_active_blocks=0, num_total_blocks=4096,
                       num_waiting=0, num_running=0, kv_fetch_bytes_per_s=50e9)  # fmt: skip
    r._on_load(load)  # what the router does with each load message it follows
    d = await r.route(req("a"))
    assert d.instance_id == "w1" and d.kv_fetch is not None


async def test_no_hint_when_the_fetch_does_not_pay_or_is_off() -> None:
    slow = router(gbps=0.5)  # 134 MB at 0.5 GB/s: 268 ms > 51 ms of prefill
    d = await slow.route(req("a"))
    assert d.kv_fetch is None and slow.explain(req("e"))["kv_fetch"] is None
    off = router(gbps=50.0, kv_fetch=False)
    d = await off.route(req("b"))
    assert d.kv_fetch is None and off.metrics.kv_fetches == 0


def test_flags_router_default_on_and_serve_starts_fetching_workers_only_when_asked() -> None:
    from tandem.cli.serve import _validate, build_parser, worker_specs
    from tandem.router.args import router_config_from_args

    def parsed(*argv: str):
        args, rest = build_parser().parse_known_args(["--engine", "mocker", *argv])
        _validate(args)
        return args, worker_specs(args, rest)

    args, specs = parsed("--router", "kv", "--workers", "2")
    assert router_config_from_args(args).kv_fetch  # on: it acts only between --kv-fetch workers
    assert all("--kv-fetch" not in s.argv for s in specs)
    args, specs = parsed("--router", "kv", "--workers", "2", "--kv-fetch")
    assert len(specs) == 2 and all("--kv-fetch" in s.argv for s in specs)
    args, _ = parsed("--router", "kv", "--no-kv-fetch", "--kv-fetch-setup-ms", "3")
    config = router_config_from_args(args)
    assert not config.kv_fetch and config.kv_fetch_setup_s == pytest.approx(0.003)


def test_worker_kv_fetch_refuses_an_engine_that_cannot_export() -> None:
    import argparse

    from tandem.cli.worker import add_arguments, build_engine

    argv = ["--engine", "mocker", "--kv-fetch"]
    parser = argparse.ArgumentParser()
    add_arguments(parser, argv)
    args = parser.parse_known_args(argv)[0]
    args.engine = "encoder"  # no KV to export; refused before it loads
    with pytest.raises(ValueError, match="--kv-fetch needs --engine mocker, native or vllm"):
        build_engine(args)


async def test_a_worker_caching_part_of_the_prefix_is_told_to_pull_only_the_rest() -> None:
    """w1 caches the prompt's first 40 blocks: its plan moves (and charges) the other 24, and
    the hint names the whole prefix (w1 keeps what it caches)."""
    fast = router(gbps=50.0)
    fast.indexer.store(WorkerKey("w1"), sequence_hashes(PROMPT, B)[:40])
    plan = fast.explain(req("e"))["kv_fetch"]
    assert (plan["first_block"], plan["num_blocks"]) == (40, 24)
    assert plan["num_bytes"] == 24 * B * KV_BYTES
    d = await fast.route(req("a"))
    assert d.instance_id == "w1" and d.kv_fetch is not None
    assert d.kv_fetch.block_hashes == sequence_hashes(PROMPT, B)
    assert d.details["kv_fetch"] == {"source": "w0", "blocks": 24}
    assert fast.metrics.kv_fetch_blocks == 24
    assert fast.decisions.snapshot(1)[0]["kv_fetch"] == {"source": "w0", "blocks": 24}


async def test_no_fetch_for_a_worker_already_computing_that_prefix() -> None:
    """w1 is prefilling the same prompt (in flight): its blocks come without a fetch."""
    r = router(gbps=50.0)
    r.active.add("same", "w1", sequence_hashes(PROMPT, B), 1024)
    scored = r.score(req("a"), list(r._instances.instances.values()))
    assert all(c.fetch is None for c in scored.costs)


async def test_measured_setup_time_is_charged() -> None:
    """w1's fetches measured 200 ms of round trips each (a loaded host): more than the
    51 ms the prefill would take, so no fetch."""
    r = router(gbps=50.0)
    load = LoadMetrics(worker_id="w1", num_active_blocks=0, num_total_blocks=4096,
                       num_waiting=0, num_running=0, kv_fetch_setup_s=0.2)  # fmt: skip
    r._on_load(load)
    assert r.explain(req("e"))["kv_fetch"] is None
    assert (await r.route(req("a"))).kv_fetch is None


async def test_measured_setup_time_replaces_the_declared_one() -> None:
    """Once w1 has measured its fetches' setup (1 ms: pooled connections), that is what the
    router charges, not the --kv-fetch-setup-ms default (5 ms) it charged before any fetch."""
    r = router(gbps=50.0)
    before = r.explain(req("e"))["kv_fetch"]
    assert before is not None
    declared = r.config.kv_fetch_setup_s * 1e3
    assert before["fetch_ms"] == pytest.approx(declared + before["num_bytes"] / 50e9 * 1e3)
    load = LoadMetrics(worker_id="w1", num_active_blocks=0, num_total_blocks=4096,
                       num_waiting=0, num_running=0, kv_fetch_setup_s=0.001)  # fmt: skip
    r._on_load(load)
    after = r.explain(req("e"))["kv_fetch"]
    assert after is not None
    assert after["fetch_ms"] == pytest.approx(1.0 + after["num_bytes"] / 50e9 * 1e3)


def test_a_fetchers_setup_time_is_the_median_of_its_recent_fetches() -> None:
    """One fetch starved for a second by a busy host barely moves the charged setup."""
    from tandem.disagg.peer_fetch import PeerFetchStats

    stats = PeerFetchStats(1e9)
    assert stats.setup_s is None  # nothing published before the first fetch
    for s in (0.001, 0.002, 1.0, 0.0015, 0.001):
        stats.add_setup(s)
    assert stats.setup_s == pytest.approx(0.0015)
