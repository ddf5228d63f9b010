"""Native engine + kvbm tiers (tandem.engines.native.tiering): a conversation whose prefix was
evicted from G1 comes back from host memory (G2) or disk (G3) with the same greedy tokens as a
cold run, a corrupt disk block is recomputed, and a stalled tier never stalls the step loop."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from pathlib import Path

import pytest
from native_tiny import request, tiny_core

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import EngineCore
from tandem.kvbm.base import BlockMeta, KvbmConfig
from tandem.kvbm.host_tier import HostTier
from tandem.kvbm.manager import BlockManager as TierManager
from tandem.protocols.kv_events import BlockStored
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(60)

BS = 4  # tokens per block (native_tiny default)
G1_BLOCKS = 16  # 64 tokens: three 24-token conversations do not fit together


def run(
    core: EngineCore, prompt: list[int], rid: str, max_tokens: int = 6
) -> tuple[list[int], int]:
    """(tokens, num_cached_tokens of the first output) of one request run to the end."""
    core.add(request(rid, prompt, max_tokens=max_tokens))
    tokens: list[int] = []
    cached = -1
    while core.has_work():
        for request_id, out in core.step():
            if request_id == rid:
                tokens += out.token_ids
                if out.num_cached_tokens is not None:
                    cached = out.num_cached_tokens
    core.block_manager.check_integrity()
    return tokens, cached


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


def conversation(core: EngineCore) -> tuple[list[int], list[list[int]]]:
    """Turn 1 of conversation A, then B..E evict it from G1 (offloaded on eviction); returns
    A's turn-2 prompt (turn 1 + answer + new user tokens) and the filler prompts."""
    a, *fillers = prompts(1, 5, 24)
    answer, _ = run(core, a, "a1")
    for i, p in enumerate(fillers):
        run(core, p, f"f{i}")
    turn2 = a + answer + prompts(2, 1, 5)[0]
    return turn2, fillers


def cold(prompt: list[int], max_tokens: int = 6, weights: str = "fp32") -> list[int]:
    core = tiny_core(num_blocks=64, enable_prefix_caching=False, weights=weights)
    return run(core, prompt, "cold", max_tokens)[0]


def tiers(tmp_path: Path | None = None, **kw: object) -> KvbmConfig:
    base: dict[str, object] = {"host_blocks": 64, "log_interval_s": 0.0}
    if tmp_path is not None:
        base.update(disk_dir=str(tmp_path), disk_blocks=64, disk_min_reuse=0, host_blocks=2)
        base["disk_direct_io"] = False
    return KvbmConfig(**{**base, **kw})  # type: ignore[arg-type]


def transferred(core: EngineCore, direction: str) -> int:
    assert core.tiering is not None
    return core.tiering.kvbm.metrics.transfers[direction].num_blocks  # type: ignore[index]


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_prefix_evicted_from_g1_is_onboarded_from_host_exactly(weights):
    core = tiny_core(num_blocks=G1_BLOCKS, kvbm=tiers(), weights=weights)
    turn2, _ = conversation(core)
    a_hashes = sequence_hashes(turn2[:24], BS)
    assert not any(h in core.block_manager.hash_to_block for h in a_hashes), "A still in G1"
    assert core.tiering is not None and core.tiering.kvbm.flush(5)
    assert core.tiering.kvbm.lookup(a_hashes) == ["host"] * 6
    tokens, cached = run(core, turn2, "a2")
    assert tokens == cold(turn2, weights=weights)
    # turn 1's prompt (24 tokens) and its first answer tokens came back: 7 full blocks
    assert cached == 28 and transferred(core, "host_to_device") == 7
    assert transferred(core, "device_to_host") >= 7
    core.close()


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_prefix_onboarded_from_disk_exactly(tmp_path: Path, weights):
    core = tiny_core(num_blocks=G1_BLOCKS, kvbm=tiers(tmp_path), weights=weights)
    turn2, _ = conversation(core)
    assert core.tiering is not None and core.tiering.kvbm.flush(5)
    a_hashes = sequence_hashes(turn2[:28], BS)
    assert core.tiering.kvbm.lookup(a_hashes) == ["disk"] * 7  # host (2 blocks) moved on
    tokens, cached = run(core, turn2, "a2")
    assert tokens == cold(turn2, weights=weights)
    assert cached == 28 and transferred(core, "disk_to_device") == 7
    assert transferred(core, "host_to_device") == 0
    core.close()


def test_corrupt_disk_block_is_dropped_and_recomputed(tmp_path: Path):
    core = tiny_core(num_blocks=G1_BLOCKS, kvbm=tiers(tmp_path))
    turn2, _ = conversation(core)
    assert core.tiering is not None and core.tiering.kvbm.flush(5)
    third = sequence_hashes(turn2[:12], BS)[2]
    path = tmp_path / f"{third:016x}.kvb"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the KV payload
    path.write_bytes(raw)
    tokens, cached = run(core, turn2, "a2")
    assert tokens == cold(turn2)
    assert cached == 2 * BS  # blocks 0 and 1 onboarded; the corrupt one and the rest computed
    assert core.tiering.kvbm.metrics.dropped["disk_corrupt"] == 1
    assert not path.exists()
    core.close()


class StalledHostTier(HostTier):
    """A host tier whose every `put` waits for the test's gate: a tier as slow as can be."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def put(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> list[int]:
        assert self.gate.wait(30), "gate never opened"
        return super().put(block_hash, data, meta)


def test_stalled_tier_never_stalls_the_step_loop():
    """Bound: while the host tier accepts nothing, the step thread's offload work per step
    (export of the step's evicted blocks + enqueue) stays under 250 ms, and every request
    still finishes with the cold run's tokens; offloads beyond the queue are skipped and
    counted. (A blocking offload would hang until the gate opens, after the loop.)"""
    core = tiny_core(num_blocks=G1_BLOCKS, kvbm=tiers(offload_queue_size=4))
    assert core.tiering is not None
    config = dataclasses.replace(core.tiering.kvbm.config)
    core.tiering.kvbm.close()
    stalled = StalledHostTier(capacity_blocks=64, block_bytes=config.block_bytes)
    core.tiering.kvbm = TierManager(config, host=stalled)
    work = prompts(3, 12, 24)
    for i, p in enumerate(work):
        tokens, _ = run(core, p, f"r{i}", max_tokens=4)
        if i < 2:
            assert tokens == cold(p, max_tokens=4)
    assert core.tiering.max_flush_s < 0.25
    assert core.tiering.num_offload_skipped > 0
    assert core.tiering.kvbm.metrics.dropped["offload_queue_full"] > 0
    stalled.gate.set()
    assert core.tiering.kvbm.flush(10)
    core.tiering.kvbm.check_integrity()
    core.close()


async def test_async_engine_publishes_tier_events_and_metrics(tmp_path: Path):
    core = tiny_core(num_blocks=G1_BLOCKS, kvbm=tiers(tmp_path, host_blocks=8))
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    events = engine.kv_events()
    a, *fillers = prompts(1, 5, 24)
    for i, p in enumerate([a, *fillers]):
        async for _ in engine.generate(request(f"r{i}", p, max_tokens=2)):
            pass
    assert core.tiering is not None
    await asyncio.to_thread(core.tiering.kvbm.flush, 5)
    a_hashes = set(sequence_hashes(a, BS))
    media: dict[str, set[int]] = {"device": set(), "host": set(), "disk": set()}
    while not a_hashes <= media["disk"]:
        for ev in await asyncio.wait_for(anext(events), 5):
            if isinstance(ev, BlockStored):
                media[ev.medium].update(ev.block_hashes)
    assert a_hashes <= media["device"] and a_hashes <= media["disk"]
    assert media["host"], "host tier announced nothing"
    snapshot = engine.kv_snapshot()
    assert {e.medium for e in snapshot} == {"device", "host", "disk"}
    text = "\n".join(engine.prometheus_lines())
    assert 'tandem_kvbm_blocks_transferred_total{direction="device_to_host"}' in text
    assert 'tandem_kvbm_tier_capacity_blocks{tier="disk"} 64' in text
    await engine.stop()


def test_kvbm_flags_reach_the_native_config(tmp_path: Path):
    import argparse

    from tandem.engines.native.args import add_args, config_from_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    ns = parser.parse_args(
        ["--kvbm-host-gb", "0.5", "--kvbm-disk-dir", str(tmp_path), "--kvbm-disk-blocks", "9"]
    )
    config = config_from_args(ns)
    assert config.kvbm is not None and config.kvbm.host_gb == 0.5
    assert config.kvbm.disk_blocks == 9
    assert config_from_args(parser.parse_args([])).kvbm is None
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        NativeConfig(kvbm=config.kvbm, enable_prefix_caching=False)
