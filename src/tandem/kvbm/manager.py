"""`BlockManager`: offload G1 → G2 (→ G3) in the background, look up and onboard prefixes.

Engine-independent: the engine hands over a block's KV (bytes or per-layer tensors) when it
leaves G1 and asks for a prefix before prefill. Two lanes (bounded queue + thread each) do the
copies: host stores, and disk writes for blocks that pass the reuse filter, so a slow disk never
delays host offloads and nothing delays the caller. Each tier has its own lock, held while
KV events for that tier are emitted, so events of one tier arrive in the order they happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.kvbm import events
from tandem.kvbm.base import BlockMeta, KvbmConfig, StorageTier, TierName
from tandem.kvbm.disk_format import file_bytes
from tandem.kvbm.disk_tier import DiskTier
from tandem.kvbm.frequency import ReuseCounter
from tandem.kvbm.host_tier import HostTier
from tandem.kvbm.lane import Lane
from tandem.kvbm.layout import BlockData, as_bytes
from tandem.kvbm.metrics import KvbmMetrics, occupancy
from tandem.protocols.kv_events import AllBlocksCleared, KvEvent

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OnboardResult:
    """The leading blocks found in G2/G3, in order: `blocks[i]` came from `tiers[i]`."""

    blocks: list[bytes] = field(default_factory=list)
    tiers: list[TierName] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, slots=True)
class _Job:
    """A G1 → G2 copy: the block's KV as the engine handed it over."""

    block_hash: int
    data: BlockData
    meta: BlockMeta


@dataclass(frozen=True, slots=True)
class _DiskJob:
    """A G2 → G3 copy: the block's bytes as the host tier holds them."""

    block_hash: int
    data: memoryview | bytes
    meta: BlockMeta


def build_tiers(config: KvbmConfig) -> tuple[StorageTier, StorageTier | None]:
    """The host tier and (when configured) the disk tier that `config` describes."""
    if not config.has_host:
        raise ValueError("kvbm needs a host tier; set host_gb or host_blocks")
    if not config.block_bytes:
        raise ValueError("block_bytes=0; the engine must set it before building tiers")
    host = HostTier(capacity_blocks=config.host_capacity_blocks(), block_bytes=config.block_bytes)
    if not config.has_disk:
        return host, None
    assert config.disk_dir is not None
    disk = DiskTier(
        directory=config.disk_dir,
        capacity_blocks=config.disk_capacity_blocks(file_bytes(config.block_bytes)),
        block_bytes=config.block_bytes,
        direct_io=config.disk_direct_io,
    )
    return host, disk


class BlockManager:
    """G2/G3 for one engine. `offload`, `lookup`, `onboard` may be called from any thread.

    `on_events` receives KV events (medium "host"/"disk") from kvbm's threads and must not
    block (e.g. `loop.call_soon_threadsafe(queue.put_nowait, events)`). Call `close()` (or use
    `with`) to finish queued copies and stop the threads.
    """

    def __init__(
        self,
        config: KvbmConfig,
        *,
        host: StorageTier | None = None,
        disk: StorageTier | None = None,
        on_events: events.EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if host is None:
            host, disk = build_tiers(config)
        self.config = config
        self._host = host
        self._disk = disk
        self._host_lock = threading.Lock()
        self._disk_lock = threading.Lock()
        self._on_events = on_events
        self._clock = clock
        self.metrics = KvbmMetrics(window_s=config.hit_rate_window_s, clock=clock)
        self._reuse = ReuseCounter(
            min_reuse=config.disk_min_reuse, max_entries=4 * host.capacity_blocks + 1024
        )
        self._disk_queued: set[int] = set()
        self._last_log = clock()
        tick_s = min(config.log_interval_s or 1.0, 1.0)
        self._offload_lane: Lane[_Job] = Lane(
            "offload",
            maxsize=config.offload_queue_size,
            handle=self._store_host,
            on_tick=self._maybe_log_summary,
            tick_s=tick_s,
        )
        self._disk_lane: Lane[_DiskJob] | None = None
        if disk is not None:
            self._disk_lane = Lane("disk", maxsize=config.disk_queue_size, handle=self._store_disk)

    # -- caller side -------------------------------------------------------------------------

    def offload(self, block_hash: int, data: BlockData, meta: BlockMeta) -> bool:
        """Queue a G1 → G2 copy of a block; False when skipped (queue full, counted as
        `offload_queue_full`). Never blocks on the copy. `data` (bytes-like, numpy array,
        torch tensor or list of per-layer tensors) must not change until the copy is done:
        pass a snapshot, or `flush()` before reusing the source."""
        if self._offload_lane.submit(_Job(block_hash, data, meta)):
            return True
        self.metrics.record_drop("offload_queue_full")
        return False

    def lookup(self, block_hashes: Sequence[int]) -> list[TierName]:
        """The tier holding each leading block of the chain (host preferred), up to the first
        block found in neither. Does not change LRU order or metrics."""
        tiers: list[TierName] = []
        for block_hash in block_hashes:
            with self._host_lock:
                in_host = self._host.contains(block_hash)
            if in_host:
                tiers.append("host")
                continue
            if self._disk is None:
                break
            with self._disk_lock:
                if not self._disk.contains(block_hash):
                    break
            tiers.append("disk")
        return tiers

    def may_hold(self, block_hash: int, tier: TierName | None = None) -> bool:
        """Lock-free hint: whether G2 (`tier="host"`), G3 (`"disk"`) or either holds the
        block now. Never waits for a copy in progress (the caller may be an engine's step
        loop); the answer may be stale by the time the caller acts on it."""
        if tier != "disk" and self._host.contains(block_hash):
            return True
        return tier != "host" and self._disk is not None and self._disk.contains(block_hash)

    def onboard(
        self,
        block_hashes: Sequence[int],
        *,
        num_device_hits: int = 0,
        num_lookup_blocks: int | None = None,
    ) -> OnboardResult:
        """Copies of the leading blocks found in G2/G3 (a partial hit returns the first k).
        A disk block that fails its checksum ends the prefix there and is dropped: the caller
        recomputes from it. `num_device_hits` (blocks the caller already had in G1, before
        `block_hashes`) and `num_lookup_blocks` (the whole prompt's full blocks, when the
        caller looked up fewer) only feed the hit-rate window."""
        result = OnboardResult()
        for block_hash in block_hashes:
            if not self.may_hold(block_hash):  # a miss never waits on a tier's lock
                break
            data, tier = self._read_block(block_hash)
            if data is None or tier is None:
                break
            result.blocks.append(data)
            result.tiers.append(tier)
        self.metrics.record_lookup(
            num_blocks=max(num_lookup_blocks or 0, num_device_hits + len(block_hashes)),
            device=num_device_hits,
            host=result.tiers.count("host"),
            disk=result.tiers.count("disk"),
        )
        return result

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued copy (host, then disk) is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        if not self._offload_lane.flush(timeout_s):
            return False
        lane = self._disk_lane
        return lane is None or lane.flush(max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        """Finish queued copies, stop the threads (idempotent)."""
        self._offload_lane.close()
        if self._disk_lane is not None:
            self._disk_lane.close()

    def __enter__(self) -> BlockManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear(self) -> None:
        """Drop every block of both tiers (e.g. after a weight reload)."""
        with self._host_lock:
            self._host.clear()
            self._emit([AllBlocksCleared(medium="host")])
        if self._disk is not None:
            with self._disk_lock:
                self._disk.clear()
                self._emit([AllBlocksCleared(medium="disk")])

    # -- observability -----------------------------------------------------------------------

    def occupancy(self) -> dict[TierName, tuple[int, int]]:
        """tier → (blocks stored, capacity in blocks)."""
        return occupancy([self._host, self._disk])

    def prometheus_lines(self) -> list[str]:
        return self.metrics.prometheus_lines(self.occupancy())

    def kv_snapshot(self) -> list[KvEvent]:
        """BlockStored events for every block held in G2 and G3 (for a router catching up)."""
        out: list[KvEvent] = []
        for tier, lock in ((self._host, self._host_lock), (self._disk, self._disk_lock)):
            if tier is None:
                continue
            with lock:
                out += events.snapshot(tier)
        return out

    def check_integrity(self) -> None:
        """AssertionError when a tier's accounting is inconsistent (tests call it often)."""
        with self._host_lock:
            self._host.check_integrity()
        if self._disk is not None:
            with self._disk_lock:
                self._disk.check_integrity()

    # -- lane side ---------------------------------------------------------------------------

    def _store_host(self, job: _Job) -> None:
        start = time.perf_counter()
        buf = as_bytes(job.data)
        with self._host_lock:
            if self._host.contains(job.block_hash):
                self._host.put(job.block_hash, buf, job.meta)  # refreshes LRU only
                return
            qualifies = self._reuse.note_use(job.block_hash)
            evicted = self._host.put(job.block_hash, buf, job.meta)
            self._emit(events.put_events(job.block_hash, job.meta, evicted, "host"))
        self.metrics.record_transfer(
            "device_to_host",
            num_blocks=1,
            num_bytes=buf.nbytes,
            seconds=time.perf_counter() - start,
        )
        if qualifies:
            self._promote(job.block_hash, buf, job.meta)

    def _promote(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> None:
        lane = self._disk_lane
        if lane is None or block_hash in self._disk_queued:
            return
        self._disk_queued.add(block_hash)
        if not lane.submit(_DiskJob(block_hash, data, meta)):
            self._disk_queued.discard(block_hash)
            self.metrics.record_drop("disk_queue_full")

    def _store_disk(self, job: _DiskJob) -> None:
        assert self._disk is not None
        start = time.perf_counter()
        try:
            with self._disk_lock:
                if self._disk.contains(job.block_hash):
                    return
                evicted = self._disk.put(job.block_hash, job.data, job.meta)
                self._emit(events.put_events(job.block_hash, job.meta, evicted, "disk"))
        except OSError as exc:
            logger.warning("disk write of block_hash=%#x failed: %s", job.block_hash, exc)
            self.metrics.record_drop("disk_write_error")
            return
        finally:
            self._disk_queued.discard(job.block_hash)
        self.metrics.record_transfer(
            "host_to_disk",
            num_blocks=1,
            num_bytes=memoryview(job.data).nbytes,
            seconds=time.perf_counter() - start,
        )

    def _read_block(self, block_hash: int) -> tuple[bytes | None, TierName | None]:
        start = time.perf_counter()
        with self._host_lock:
            data = self._host.get(block_hash)
            meta = self._host.meta(block_hash)
            qualifies = data is not None and self._reuse.note_use(block_hash)
        if data is not None:
            self.metrics.record_transfer(
                "host_to_device",
                num_blocks=1,
                num_bytes=len(data),
                seconds=time.perf_counter() - start,
            )
            if qualifies and meta is not None:
                self._promote(block_hash, data, meta)
            return data, "host"
        return self._read_disk_block(block_hash, start)

    def _read_disk_block(
        self, block_hash: int, start: float
    ) -> tuple[bytes | None, TierName | None]:
        if self._disk is None:
            return None, None
        with self._disk_lock:
            present = self._disk.contains(block_hash)
            data = self._disk.get(block_hash) if present else None
            if present and data is None:
                self._emit([events.removed([block_hash], "disk")])
        if data is None:
            if present:
                self.metrics.record_drop("disk_corrupt")
            return None, None
        self.metrics.record_transfer(
            "disk_to_device",
            num_blocks=1,
            num_bytes=len(data),
            seconds=time.perf_counter() - start,
        )
        return data, "disk"

    def _emit(self, batch: list[KvEvent]) -> None:
        if self._on_events is not None and batch:
            try:
                self._on_events(batch)
            except Exception:
                logger.exception("kvbm event sink failed; %d events lost", len(batch))

    def _maybe_log_summary(self) -> None:
        interval = self.config.log_interval_s
        now = self._clock()
        if interval and now - self._last_log >= interval:
            self._last_log = now
            logger.info("kvbm %s", self.metrics.summary(self.occupancy()))
