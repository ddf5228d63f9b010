"""BlockManager: background offload, lookup and (partial) onboarding across host and disk,
the G2 → G3 reuse filter, KV events with their medium, corruption handling, and a caller that
is never blocked by a slow tier."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.kvbm.base import BlockMeta, KvbmConfig
from tandem.kvbm.host_tier import HostTier
from tandem.kvbm.manager import BlockManager
from tandem.protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

BLOCK_BYTES = 256
pytestmark = pytest.mark.timeout(20)


def _meta(block_hash: int, parent: int | None = None) -> BlockMeta:
    return BlockMeta(block_size=4, token_ids=(block_hash,) * 4, parent_hash=parent)


def _data(block_hash: int) -> bytes:
    return bytes((block_hash + i) % 256 for i in range(BLOCK_BYTES))


def _config(tmp_path: Path | None = None, **kwargs: object) -> KvbmConfig:
    base: dict[str, object] = {"host_blocks": 4, "block_bytes": BLOCK_BYTES, "log_interval_s": 0}
    if tmp_path is not None:
        base |= {"disk_dir": str(tmp_path), "disk_blocks": 8}
    return KvbmConfig(**(base | kwargs))  # type: ignore[arg-type]


class Recorder:
    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def __call__(self, batch: list[KvEvent]) -> None:
        self.events.extend(batch)

    def stored(self, medium: str) -> list[int]:
        return [
            h for e in self.events if isinstance(e, BlockStored) and e.medium == medium
            for h in e.block_hashes
        ]  # fmt: skip

    def removed(self, medium: str) -> list[int]:
        return [
            h for e in self.events if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes
        ]  # fmt: skip


def _offload_chain(manager: BlockManager, hashes: list[int]) -> None:
    parent = None
    for h in hashes:
        assert manager.offload(h, _data(h), _meta(h, parent))
        parent = h
    assert manager.flush(5)
    manager.check_integrity()


def test_offloaded_blocks_are_onboarded_with_their_bytes() -> None:
    recorder = Recorder()
    with BlockManager(_config(), on_events=recorder) as manager:
        _offload_chain(manager, [1, 2, 3])
        assert manager.lookup([1, 2, 3]) == ["host", "host", "host"]
        result = manager.onboard([1, 2, 3])
        assert result.blocks == [_data(1), _data(2), _data(3)]
        assert result.tiers == ["host"] * 3
    assert recorder.stored("host") == [1, 2, 3]
    first = recorder.events[0]
    assert isinstance(first, BlockStored) and first.token_ids == [1, 1, 1, 1]
    assert isinstance(recorder.events[1], BlockStored) and recorder.events[1].parent_hash == 1


def test_partial_prefix_onboards_the_first_k_blocks() -> None:
    with BlockManager(_config()) as manager:
        _offload_chain(manager, [1, 2, 4])  # 3 is missing
        assert manager.lookup([1, 2, 3, 4]) == ["host", "host"]
        result = manager.onboard([1, 2, 3, 4], num_device_hits=1)
        assert result.num_blocks == 2 and result.blocks == [_data(1), _data(2)]
        assert manager.onboard([9, 1]).num_blocks == 0
        rates = manager.metrics.hit_rates()
    assert rates["device"] == pytest.approx(1 / 7)
    assert rates["host"] == pytest.approx(2 / 7)
    assert rates["disk"] == 0.0


def test_host_eviction_emits_block_removed_with_host_medium() -> None:
    recorder = Recorder()
    with BlockManager(_config(host_blocks=2), on_events=recorder) as manager:
        _offload_chain(manager, [1, 2, 3])
        assert manager.lookup([1]) == [] and manager.lookup([2, 3]) == ["host", "host"]
    assert recorder.removed("host") == [1]
    assert manager.occupancy() == {"host": (2, 2)}


def test_reuse_filter_sends_only_reused_blocks_to_disk(tmp_path: Path) -> None:
    recorder = Recorder()
    with BlockManager(_config(tmp_path, disk_min_reuse=1), on_events=recorder) as manager:
        _offload_chain(manager, [1, 2])
        assert recorder.stored("disk") == []  # offloaded once: not reused yet
        manager.onboard([1])  # block 1 comes back: reused once
        assert manager.flush(5)
        manager.check_integrity()
        assert recorder.stored("disk") == [1]
        assert manager.occupancy()["disk"] == (1, 8)


def test_reuse_filter_disabled_writes_every_block(tmp_path: Path) -> None:
    recorder = Recorder()
    with BlockManager(_config(tmp_path, disk_min_reuse=0), on_events=recorder) as manager:
        _offload_chain(manager, [1, 2, 3])
        assert sorted(recorder.stored("disk")) == [1, 2, 3]


def test_higher_threshold_needs_more_reuses(tmp_path: Path) -> None:
    recorder = Recorder()
    with BlockManager(_config(tmp_path, disk_min_reuse=2), on_events=recorder) as manager:
        _offload_chain(manager, [1])
        manager.onboard([1])
        assert manager.flush(5) and recorder.stored("disk") == []
        manager.onboard([1])
        assert manager.flush(5) and recorder.stored("disk") == [1]


def test_prefix_spanning_host_and_disk(tmp_path: Path) -> None:
    config = _config(tmp_path, host_blocks=2, disk_min_reuse=0)
    with BlockManager(config) as manager:
        _offload_chain(manager, [1, 2, 3, 4])  # host keeps 3, 4; disk has all
        assert manager.lookup([1, 2, 3, 4]) == ["disk", "disk", "host", "host"]
        result = manager.onboard([1, 2, 3, 4, 5])
        assert result.tiers == ["disk", "disk", "host", "host"]
        assert result.blocks == [_data(h) for h in (1, 2, 3, 4)]
        moved = manager.metrics.transfers
        assert moved["disk_to_device"].num_blocks == 2
        assert moved["disk_to_device"].num_bytes == 2 * BLOCK_BYTES
        assert moved["host_to_device"].num_blocks == 2
        assert moved["device_to_host"].num_blocks == 4
        assert moved["host_to_disk"].num_blocks == 4
        assert manager.metrics.hit_rates()["disk"] == pytest.approx(2 / 5)


def test_corrupt_disk_block_ends_the_prefix_and_is_reported(tmp_path: Path) -> None:
    recorder = Recorder()
    config = _config(tmp_path, host_blocks=1, disk_min_reuse=0)
    with BlockManager(config, on_events=recorder) as manager:
        _offload_chain(manager, [1, 2, 3])  # host keeps 3; 1 and 2 only on disk
        path = tmp_path / f"{2:016x}.kvb"
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0x01
        path.write_bytes(raw)
        result = manager.onboard([1, 2, 3])
        assert result.tiers == ["disk"] and result.blocks == [_data(1)]
        manager.check_integrity()
        assert manager.lookup([1, 2, 3]) == ["disk"]
        assert manager.metrics.dropped["disk_corrupt"] == 1
    assert recorder.removed("disk") == [2]


class GatedHostTier(HostTier):
    """A host tier whose `put` waits until the test opens the gate: a tier as slow as can be."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> list[int]:
        self.entered.set()
        assert self.gate.wait(10), "gate never opened"
        return super().put(block_hash, data, meta)


def test_full_queue_skips_and_never_blocks_the_caller() -> None:
    """Bound: with the tier stalled for the whole test, every offload() returns within 50 ms
    (it does not wait for the copy: a blocking call would hang until the gate opens)."""
    tier = GatedHostTier(capacity_blocks=64, block_bytes=BLOCK_BYTES)
    config = _config(host_blocks=64, offload_queue_size=4)
    with BlockManager(config, host=tier) as manager:
        assert manager.offload(0, _data(0), _meta(0))
        assert tier.entered.wait(5)  # block 0 is in the stalled put; the queue is empty
        durations, accepted = [], []
        for h in range(1, 21):
            start = time.perf_counter()
            accepted.append(manager.offload(h, _data(h), _meta(h)))
            durations.append(time.perf_counter() - start)
        assert max(durations) < 0.05
        assert accepted == [True] * 4 + [False] * 16
        assert manager.metrics.dropped["offload_queue_full"] == 16
        tier.gate.set()
        assert manager.flush(5)
        manager.check_integrity()
        assert manager.lookup(list(range(5))) == ["host"] * 5
        assert manager.lookup([5]) == []


def test_offload_of_per_layer_tensors_round_trips() -> None:
    torch = pytest.importorskip("torch")
    from tandem.kvbm.layout import split_like

    layers = [torch.randn(2, 4, 8, dtype=torch.float16) for _ in range(3)]
    block_bytes = sum(t.numel() * t.element_size() for t in layers)
    config = _config(block_bytes=block_bytes)
    with BlockManager(config) as manager:
        assert manager.offload(7, [t.clone() for t in layers], _meta(7))
        assert manager.flush(5)
        (data,) = manager.onboard([7]).blocks
    restored = split_like(data, layers)
    assert all(torch.equal(a, b) for a, b in zip(restored, layers, strict=True))


def test_kv_snapshot_clear_and_prometheus(tmp_path: Path) -> None:
    recorder = Recorder()
    config = _config(tmp_path, disk_min_reuse=0)
    with BlockManager(config, on_events=recorder) as manager:
        _offload_chain(manager, [1, 2])
        snapshot = manager.kv_snapshot()
        assert sorted((e.medium, e.block_hashes[0]) for e in snapshot) == [  # type: ignore[union-attr]
            ("disk", 1), ("disk", 2), ("host", 1), ("host", 2),
        ]  # fmt: skip
        text = "\n".join(manager.prometheus_lines())
        assert 'tandem_kvbm_blocks_transferred_total{direction="device_to_host"} 2' in text
        assert 'tandem_kvbm_tier_blocks{tier="disk"} 2' in text
        assert 'tandem_kvbm_tier_capacity_blocks{tier="host"} 4' in text
        manager.clear()
        manager.check_integrity()
        assert manager.lookup([1]) == [] and manager.occupancy()["disk"] == (0, 8)
    cleared = [e.medium for e in recorder.events if isinstance(e, AllBlocksCleared)]
    assert cleared == ["host", "disk"]


def test_close_finishes_queued_copies() -> None:
    manager = BlockManager(_config())
    for h in range(4):
        manager.offload(h, _data(h), _meta(h))
    manager.close()
    assert manager.lookup([0, 1, 2, 3]) == ["host"] * 4
    assert manager.offload(9, _data(9), _meta(9)) is False  # closed


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["offload", "onboard"]), st.lists(st.integers(0, 9), max_size=4)),
        max_size=25,
    ),
    min_reuse=st.integers(0, 2),
)
def test_random_traffic_keeps_tiers_consistent_and_data_exact(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, list[int]]], min_reuse: int
) -> None:
    """Whatever the order of offloads and onboards: capacity and slot accounting hold after
    each step, onboard agrees with the lookup made just before it, and every block returned
    carries exactly the bytes offloaded under its hash."""
    config = _config(tmp_path_factory.mktemp("disk"), host_blocks=3, disk_blocks=4)
    config = dataclasses.replace(config, disk_min_reuse=min_reuse)
    with BlockManager(config) as manager:
        for op, hashes in ops:
            if op == "offload":
                for h in hashes:
                    manager.offload(h, _data(h), _meta(h))
            else:
                expected = manager.lookup(hashes)
                result = manager.onboard(hashes)
                assert result.tiers == expected
                assert result.blocks == [_data(h) for h in hashes[: result.num_blocks]]
            assert manager.flush(5)
            manager.check_integrity()
            used = manager.occupancy()
            assert used["host"][0] <= 3 and used["disk"][0] <= 4
