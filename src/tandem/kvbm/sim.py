"""Tiers without data for the mocker: the same LRU, capacity, reuse filter, KV events and
metrics as `BlockManager`, with copy times modelled as bytes / bandwidth.

`SimBlockManager` is synchronous and deterministic: time comes from an injected clock (the
mocker's simulated clock), copies are reserved on a link that serialises them, and an offload
that finds `offload_queue_size` copies still in flight is skipped, as the real queue would.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.kvbm import events
from tandem.kvbm.base import BlockMeta, KvbmConfig, TierName
from tandem.kvbm.disk_format import file_bytes
from tandem.kvbm.frequency import ReuseCounter
from tandem.kvbm.lru import LruTier, TierEntry
from tandem.kvbm.metrics import Direction, KvbmMetrics, occupancy
from tandem.protocols.kv_events import KvEvent

logger = logging.getLogger(__name__)


class SimTier(LruTier[TierEntry]):
    """`StorageTier` keeping hashes, sizes and metadata only; `get` returns b"" on a hit."""

    def __init__(self, name: TierName, *, capacity_blocks: int, block_bytes: int) -> None:
        super().__init__(capacity_blocks=capacity_blocks, block_bytes=block_bytes)
        self.name = name

    def put(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> list[int]:
        return self.put_sized(block_hash, len(data) or self._block_bytes, meta)

    def put_sized(self, block_hash: int, num_bytes: int, meta: BlockMeta) -> list[int]:
        if num_bytes > self._block_bytes:
            raise ValueError(f"block of {num_bytes} bytes exceeds block_bytes={self._block_bytes}")
        if self._index.touch(block_hash) is not None:
            return []
        evicted = self._make_room()
        self._index.insert(block_hash, TierEntry(num_bytes=num_bytes, meta=meta))
        return evicted

    def get(self, block_hash: int) -> bytes | None:
        return None if self._index.touch(block_hash) is None else b""

    def size_of(self, block_hash: int) -> int:
        entry = self._index.peek(block_hash)
        return 0 if entry is None else entry.num_bytes

    def clear(self) -> list[int]:
        return self._index.clear()

    def check_integrity(self) -> None:
        assert len(self._index) <= self.capacity_blocks, "more blocks than capacity"
        assert all(0 < e.num_bytes <= self._block_bytes for _, e in self._index.items())


class SimLink:
    """A copy engine with `bytes_per_s` that runs copies one after another; at most
    `max_in_flight` copies may be pending (queued or running) at a time."""

    def __init__(self, *, bytes_per_s: float, max_in_flight: int) -> None:
        self.bytes_per_s = bytes_per_s
        self.max_in_flight = max_in_flight
        self._done_at: deque[float] = deque()

    def copy_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.bytes_per_s

    def reserve(self, num_bytes: int, now: float) -> float | None:
        """When the copy finishes (absolute time), or None when the link is saturated."""
        while self._done_at and self._done_at[0] <= now:
            self._done_at.popleft()
        if len(self._done_at) >= self.max_in_flight:
            return None
        start = self._done_at[-1] if self._done_at else now
        done = max(start, now) + self.copy_seconds(num_bytes)
        self._done_at.append(done)
        return done


@dataclass(frozen=True, slots=True)
class SimOnboard:
    """Leading blocks found in G2/G3, and the simulated seconds to copy them into G1."""

    tiers: list[TierName] = field(default_factory=list)
    seconds: float = 0.0
    num_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)


class SimBlockManager:
    """`BlockManager`'s accounting without data or threads (not thread-safe; the mocker's step
    loop owns it). KV events are delivered synchronously to `on_events`."""

    def __init__(
        self,
        config: KvbmConfig,
        *,
        on_events: events.EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not config.has_host or not config.block_bytes:
            raise ValueError("SimBlockManager needs a host tier and block_bytes > 0")
        self.config = config
        self._clock = clock
        self._on_events = on_events
        bb = config.block_bytes
        self.host = SimTier("host", capacity_blocks=config.host_capacity_blocks(), block_bytes=bb)
        self.disk: SimTier | None = None
        if config.has_disk:
            capacity = config.disk_capacity_blocks(file_bytes(bb))
            self.disk = SimTier("disk", capacity_blocks=capacity, block_bytes=bb)
        gbps = 1e9
        self.host_link = SimLink(
            bytes_per_s=config.host_bandwidth_gbps * gbps, max_in_flight=config.offload_queue_size
        )
        self.disk_link = SimLink(
            bytes_per_s=config.disk_bandwidth_gbps * gbps, max_in_flight=config.disk_queue_size
        )
        self.metrics = KvbmMetrics(window_s=config.hit_rate_window_s, clock=clock)
        self._reuse = ReuseCounter(
            min_reuse=config.disk_min_reuse, max_entries=4 * self.host.capacity_blocks + 1024
        )
        self._last_log = clock()

    def tick(self) -> None:
        """Log the hit-rate summary once `log_interval_s` passed on the clock (the mocker
        calls it every step; 0 = never)."""
        interval = self.config.log_interval_s
        now = self._clock()
        if interval and now - self._last_log >= interval:
            self._last_log = now
            logger.info("kvbm (simulated) %s", self.metrics.summary(self.occupancy()))

    def offload(self, block_hash: int, meta: BlockMeta, num_bytes: int | None = None) -> bool:
        """Account a G1 → G2 copy; False when skipped because the link is saturated."""
        if self.host.get(block_hash) is not None:  # already offloaded: refresh LRU only
            return True
        size = num_bytes or self.config.block_bytes
        if self.host_link.reserve(size, self._clock()) is None:
            self.metrics.record_drop("offload_queue_full")
            return False
        qualifies = self._reuse.note_use(block_hash)
        self._store(self.host, block_hash, size, meta, "device_to_host")
        if qualifies:
            self._promote(block_hash, size, meta)
        return True

    def lookup(self, block_hashes: Sequence[int]) -> list[TierName]:
        """The tier of each leading block present in G2 or G3 (host preferred)."""
        tiers: list[TierName] = []
        for block_hash in block_hashes:
            if self.host.contains(block_hash):
                tiers.append("host")
            elif self.disk is not None and self.disk.contains(block_hash):
                tiers.append("disk")
            else:
                break
        return tiers

    def onboard(
        self,
        block_hashes: Sequence[int],
        *,
        num_device_hits: int = 0,
        num_lookup_blocks: int | None = None,
    ) -> SimOnboard:
        """Account copying the leading G2/G3 hits into G1; their simulated times add up."""
        tiers: list[TierName] = []
        seconds = 0.0
        num_bytes = 0
        for block_hash in block_hashes:
            hit = self._onboard_one(block_hash)
            if hit is None:
                break
            tiers.append(hit[0])
            seconds += hit[1]
            num_bytes += hit[2]
        self.metrics.record_lookup(
            num_blocks=max(num_lookup_blocks or 0, num_device_hits + len(block_hashes)),
            device=num_device_hits,
            host=tiers.count("host"),
            disk=tiers.count("disk"),
        )
        return SimOnboard(tiers=tiers, seconds=seconds, num_bytes=num_bytes)

    def _onboard_one(self, block_hash: int) -> tuple[TierName, float, int] | None:
        if self.host.get(block_hash) is not None:
            tier_name: TierName = "host"
            direction: Direction = "host_to_device"
            size, link = self.host.size_of(block_hash), self.host_link
        elif self.disk is not None and self.disk.get(block_hash) is not None:
            tier_name = "disk"
            direction = "disk_to_device"
            size, link = self.disk.size_of(block_hash), self.disk_link
        else:
            return None
        seconds = link.copy_seconds(size)
        self.metrics.record_transfer(direction, num_blocks=1, num_bytes=size, seconds=seconds)
        if tier_name == "host" and self._reuse.note_use(block_hash):
            meta = self.host.meta(block_hash)
            assert meta is not None
            self._promote(block_hash, size, meta)
        return tier_name, seconds, size

    def occupancy(self) -> dict[TierName, tuple[int, int]]:
        return occupancy([self.host, self.disk])

    def prometheus_lines(self) -> list[str]:
        return self.metrics.prometheus_lines(self.occupancy())

    def kv_snapshot(self) -> list[KvEvent]:
        """BlockStored events for every block held in G2 and G3 (for a router catching up)."""
        tiers = [self.host] if self.disk is None else [self.host, self.disk]
        return [event for tier in tiers for event in events.snapshot(tier)]

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

    def _promote(self, block_hash: int, size: int, meta: BlockMeta) -> None:
        if self.disk is None or self.disk.contains(block_hash):
            return
        if self.disk_link.reserve(size, self._clock()) is None:
            self.metrics.record_drop("disk_queue_full")
            return
        self._store(self.disk, block_hash, size, meta, "host_to_disk")

    def _store(
        self, tier: SimTier, block_hash: int, size: int, meta: BlockMeta, direction: Direction
    ) -> None:
        evicted = tier.put_sized(block_hash, size, meta)
        link = self.disk_link if tier is self.disk else self.host_link
        self.metrics.record_transfer(
            direction, num_blocks=1, num_bytes=size, seconds=link.copy_seconds(size)
        )
        if self._on_events is not None:
            self._on_events(events.put_events(block_hash, meta, evicted, tier.name))
