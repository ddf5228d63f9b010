"""Mocker + simulated kvbm tiers (`--kvbm-*`): blocks evicted from the device pool are
offloaded (events with medium host/disk), a returning prefix is onboarded as cached tokens
with its simulated copy time added to the step, and the flags reach the config."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from tandem.engines.mocker.args import add_args, config_from_args
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.mocker.scheduler import Scheduler
from tandem.kvbm.base import KvbmConfig
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, StopConditions
from tandem.protocols.kv_events import BlockRemoved, BlockStored, KvEvent

pytestmark = pytest.mark.timeout(20)
BS = 4


def config(kvbm: KvbmConfig | None, **kw: object) -> MockerConfig:
    base: dict[str, object] = {
        "num_blocks": 16, "block_size": BS, "speedup_ratio": 0, "tokenizer": None,
        "kv_bytes_per_token": 1 << 16, "kvbm": kvbm,
    }  # fmt: skip
    return MockerConfig(**{**base, **kw})  # type: ignore[arg-type]


def run(s: Scheduler, rid: str, prompt: list[int], events: list[KvEvent]) -> tuple[int, float]:
    """Run one request alone; (num_cached_tokens, simulated ms of its first step)."""
    s.add_request(
        PreprocessedRequest(
            request_id=rid, model="m", token_ids=prompt, stop=StopConditions(max_tokens=3)
        )
    )
    cached, first_ms = -1, -1.0
    while s.has_work:
        result = s.step()
        s.check_integrity()
        if first_ms < 0:
            first_ms = result.duration_ms
        events += result.events
        for seq, out in result.outputs:
            if seq.request_id == rid and out.num_cached_tokens is not None:
                cached = out.num_cached_tokens
    assert s.kvbm is not None
    s.kvbm.check_integrity()
    return cached, first_ms


def stored(events: list[KvEvent], medium: str) -> set[int]:
    return {h for e in events if isinstance(e, BlockStored) and e.medium == medium
            for h in e.block_hashes}  # fmt: skip


def conversation(s: Scheduler, events: list[KvEvent]) -> tuple[list[int], set[int]]:
    rng = random.Random(0)
    a, *fillers = [[rng.randrange(20, 5000) for _ in range(24)] for _ in range(5)]
    run(s, "a1", a, events)
    a_blocks = stored(events, "device")
    for i, p in enumerate(fillers):
        run(s, f"f{i}", p, events)
    evicted = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "device"
               for h in e.block_hashes}  # fmt: skip
    assert a_blocks <= evicted, "the conversation was not evicted from G1"
    return [*a, 7, 8, 9, 10, 11], a_blocks


def onboard_step_ms(host_gbps: float) -> tuple[int, float, Scheduler]:
    tiers = KvbmConfig(host_blocks=64, host_bandwidth_gbps=host_gbps, log_interval_s=0)
    s = Scheduler(config(tiers))
    events: list[KvEvent] = []
    turn2, a_blocks = conversation(s, events)
    assert a_blocks <= stored(events, "host")
    cached, first_ms = run(s, "a2", turn2, events)
    return cached, first_ms, s


def test_evicted_prefix_comes_back_from_host_with_its_copy_time():
    cached, slow_ms, s = onboard_step_ms(0.1)
    assert cached == 24  # all six prompt blocks of turn 1 were onboarded
    assert s.kvbm is not None and s.kvbm.metrics.transfers["host_to_device"].num_blocks == 6
    _, fast_ms, _ = onboard_step_ms(1000.0)
    copy_ms = 6 * BS * (1 << 16) / 0.1e9 * 1000  # 6 blocks of 256 KiB at 0.1 GB/s: 15.7 ms
    assert slow_ms - fast_ms == pytest.approx(copy_ms, rel=0.01)


def test_disk_tier_events_and_onboard(tmp_path: Path):
    tiers = KvbmConfig(host_blocks=2, disk_dir=str(tmp_path), disk_blocks=64, disk_min_reuse=0,
                       log_interval_s=0)  # fmt: skip
    s = Scheduler(config(tiers))
    events: list[KvEvent] = []
    turn2, a_blocks = conversation(s, events)
    assert a_blocks <= stored(events, "disk")
    host_removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "host"
                    for h in e.block_hashes}  # fmt: skip
    assert a_blocks <= host_removed  # host holds 2 blocks: the conversation aged out of it
    cached, _ = run(s, "a2", turn2, events)
    assert cached == 24
    assert s.kvbm is not None and s.kvbm.metrics.transfers["disk_to_device"].num_blocks == 6
    assert not list(tmp_path.iterdir()), "the simulated disk tier wrote files"


async def test_engine_snapshot_and_metrics_include_tiers():
    engine = MockerEngine(config(KvbmConfig(host_blocks=64, log_interval_s=0)))
    await engine.start()
    rng = random.Random(1)
    for i in range(5):
        prompt = [rng.randrange(20, 5000) for _ in range(24)]
        req = PreprocessedRequest(request_id=f"r{i}", model="m", token_ids=prompt,
                                  stop=StopConditions(max_tokens=2))  # fmt: skip
        outs: list[EngineOutput] = [o async for o in engine.generate(req)]
        assert outs[-1].finish_reason == "length"
    media = {e.medium for e in engine.kv_snapshot() if isinstance(e, BlockStored)}
    assert media == {"device", "host"}
    text = "\n".join(engine.prometheus_lines())
    assert 'tandem_kvbm_tier_blocks{tier="host"}' in text
    await engine.stop()


def test_flags_reach_the_mocker_config(tmp_path: Path):
    parser = argparse.ArgumentParser()
    add_args(parser)
    ns = parser.parse_args(["--kvbm-host-blocks", "32", "--kvbm-disk-dir", str(tmp_path),
                            "--kvbm-disk-gb", "1", "--tokenizer", "none"])  # fmt: skip
    cfg = config_from_args(ns)
    assert cfg.kvbm is not None and cfg.kvbm.host_blocks == 32 and cfg.kvbm.disk_gb == 1
    assert config_from_args(parser.parse_args(["--tokenizer", "none"])).kvbm is None
    s = Scheduler(cfg)  # GB capacity resolved from kv_bytes_per_token x block_size
    assert s.kvbm is not None and s.kvbm.occupancy()["host"] == (0, 32)


def test_summary_line_logged_on_the_simulated_clock(caplog: pytest.LogCaptureFixture):
    tiers = KvbmConfig(host_blocks=64, log_interval_s=0.01)
    s = Scheduler(config(tiers))
    events: list[KvEvent] = []
    with caplog.at_level("INFO", logger="tandem.kvbm.sim"):
        conversation(s, events)
    lines = [r.getMessage() for r in caplog.records if "kvbm (simulated)" in r.getMessage()]
    assert lines and "occupancy host=" in lines[-1]
    assert len(lines) <= s.clock_ms / 10 + 1  # at most one per 10 simulated ms
