"""SimBlockManager: the mocker's tiers — capacity and LRU, reuse filter, events with medium,
and copy times accounted as bytes / bandwidth on a simulated clock."""

from __future__ import annotations

import pytest

from tandem.kvbm.base import BlockMeta, KvbmConfig
from tandem.kvbm.sim import SimBlockManager, SimLink
from tandem.protocols.kv_events import BlockRemoved, BlockStored, KvEvent

MB = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _meta(h: int) -> BlockMeta:
    return BlockMeta(block_size=16, token_ids=(h,) * 16)


def _sim(
    clock: FakeClock, events: list[KvEvent] | None = None, **kwargs: object
) -> SimBlockManager:
    base: dict[str, object] = {
        "host_blocks": 4,
        "disk_dir": "/nonexistent-sim-only",
        "disk_blocks": 8,
        "block_bytes": 10 * MB,
        "host_bandwidth_gbps": 10.0,  # 10 MB block → 1 ms
        "disk_bandwidth_gbps": 1.0,  # 10 MB block → 10 ms
        "disk_min_reuse": 1,
    }
    config = KvbmConfig(**(base | kwargs))  # type: ignore[arg-type]
    return SimBlockManager(config, clock=clock, on_events=None if events is None else events.extend)


def test_onboard_time_is_bytes_over_bandwidth_per_tier() -> None:
    clock = FakeClock()
    sim = _sim(clock, disk_min_reuse=0, host_blocks=2)
    for h in (1, 2, 3):
        assert sim.offload(h, _meta(h))
        clock.now += 1.0
    sim.check_integrity()
    assert sim.lookup([1, 2, 3, 4]) == ["disk", "host", "host"]
    result = sim.onboard([1, 2, 3, 4])
    assert result.tiers == ["disk", "host", "host"]
    assert result.seconds == pytest.approx(0.010 + 2 * 0.001)
    assert result.num_bytes == 30 * MB
    transfers = sim.metrics.transfers
    assert transfers["device_to_host"].seconds == pytest.approx(3 * 0.001)
    assert transfers["host_to_disk"].num_blocks == 3
    assert sim.metrics.hit_rates()["host"] == pytest.approx(2 / 4)


def test_saturated_link_skips_offloads_until_copies_finish() -> None:
    clock = FakeClock()
    sim = _sim(clock, offload_queue_size=2, host_blocks=8)
    assert [sim.offload(h, _meta(h)) for h in range(4)] == [True, True, False, False]
    assert sim.metrics.dropped["offload_queue_full"] == 2
    clock.now += 0.0015  # the first 1 ms copy is done, the second still runs
    assert sim.offload(10, _meta(10)) and not sim.offload(11, _meta(11))
    clock.now += 1.0
    assert sim.offload(12, _meta(12))
    assert sim.lookup([0, 1, 10, 12]) == ["host"] * 4


def test_link_serialises_copies() -> None:
    link = SimLink(bytes_per_s=1000.0, max_in_flight=3)
    assert link.reserve(1000, now=0.0) == pytest.approx(1.0)
    assert link.reserve(500, now=0.2) == pytest.approx(1.5)
    assert link.reserve(500, now=5.0) == pytest.approx(5.5)


def test_reuse_filter_and_events_carry_the_medium() -> None:
    clock = FakeClock()
    events: list[KvEvent] = []
    sim = _sim(clock, events, host_blocks=2)
    for h in (1, 2):
        sim.offload(h, _meta(h))
    assert sim.disk is not None and sim.disk.num_blocks == 0
    sim.onboard([1])  # reused once → disk
    sim.offload(3, _meta(3))  # evicts 2 from host
    sim.check_integrity()
    stored = [(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)]
    assert stored == [("host", 1), ("host", 2), ("disk", 1), ("host", 3)]
    removed = [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockRemoved)]
    assert removed == [("host", [2])]
    assert sim.occupancy() == {"host": (2, 2), "disk": (1, 8)}
    assert 'tandem_kvbm_tier_blocks{tier="disk"} 1' in sim.prometheus_lines()


def test_repeated_offload_only_refreshes() -> None:
    clock = FakeClock()
    sim = _sim(clock, host_blocks=2)
    sim.offload(1, _meta(1))
    sim.offload(2, _meta(2))
    sim.offload(1, _meta(1))  # 1 becomes most recent, no second copy
    sim.offload(3, _meta(3))
    assert sim.lookup([1]) == ["host"] and sim.lookup([2]) == []
    assert sim.metrics.transfers["device_to_host"].num_blocks == 3


def test_host_only_config_has_no_disk() -> None:
    sim = SimBlockManager(KvbmConfig(host_blocks=2, block_bytes=64), clock=FakeClock())
    sim.offload(1, _meta(1))
    assert sim.onboard([1, 2]).tiers == ["host"]
    assert sim.occupancy() == {"host": (1, 2)}
