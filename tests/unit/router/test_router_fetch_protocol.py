"""Peer KV fetch pairs a fetcher only with a holder whose KV moves the same way: vLLM
workers (protocol ``vllm-nixl``) with vLLM workers, native/mocker workers (tandem's transfer
agents) with theirs; a vLLM holder's hint carries its request-plane address for the export."""

from __future__ import annotations

import msgspec
import pytest
from tests.support.instances import backend_instance

from tandem.protocols.discovery import Instance, ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.config import RouterConfig
from tandem.router.fetch import FetchSource
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(10)
B = 16
PROMPT = list(range(1024))


def instance(i: int, protocol: str | None) -> Instance:
    card = ModelCard(name="m", context_length=8192, block_size=B, num_total_blocks=4096)
    entry = {"address": ["127.0.0.1", 7000 + i], "agent_id": f"agent{i}",
             "bytes_per_token": 1000, "bandwidth_bytes_per_s": 50e9,
             "prefill_s_per_token": 50e-6}  # fmt: skip
    if protocol is not None:
        entry["protocol"] = protocol
    return msgspec.structs.replace(backend_instance(i, card), metadata={"kv_fetch": entry})


def router(protocols: list[str | None]) -> KvRouter:
    instances = StaticInstanceSet([instance(i, p) for i, p in enumerate(protocols)])
    r = make_router("kv", RouterConfig(seed=0), instances=instances)
    assert isinstance(r, KvRouter)
    r.indexer.store(WorkerKey("w0"), sequence_hashes(PROMPT, B))  # w0 holds the prompt
    for i in range(6):  # and is busy
        r.active.add(f"x{i}", "w0", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 64)), 1024)
    return r


def req(rid: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=PROMPT, stop=StopConditions(max_tokens=4)
    )


def test_metadata_protocol_is_read_and_absent_means_tandems_own() -> None:
    assert FetchSource.from_metadata(instance(0, "vllm-nixl").metadata).protocol == "vllm-nixl"  # type: ignore[union-attr]
    assert FetchSource.from_metadata(instance(0, None).metadata).protocol is None  # type: ignore[union-attr]


async def test_vllm_holder_and_fetcher_pair_and_the_hint_names_the_holders_address() -> None:
    r = router(["vllm-nixl", "vllm-nixl"])
    d = await r.route(req("a"))
    assert d.instance_id == "w1" and d.kv_fetch is not None
    assert d.kv_fetch.protocol == "vllm-nixl" and d.kv_fetch.export is None
    holder = r._instances.instances["w0"]
    assert d.kv_fetch.source_address == holder.address
    assert d.kv_fetch.block_hashes == sequence_hashes(PROMPT, B)


async def test_no_fetch_across_protocols() -> None:
    for protocols in (["vllm-nixl", None], [None, "vllm-nixl"]):
        r = router(protocols)
        d = await r.route(req("a"))
        assert d.kv_fetch is None, protocols
        assert r.explain(req("e"))["kv_fetch"] is None


async def test_tandems_own_hint_is_unchanged() -> None:
    d = await router([None, None]).route(req("a"))
    assert d.kv_fetch is not None and d.kv_fetch.protocol is None
    assert d.kv_fetch.source_address is None and d.kv_fetch.address == ("127.0.0.1", 7000)
