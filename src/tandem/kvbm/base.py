"""Contracts of the KV block manager (DESIGN.md §9): tiers, block metadata and config.

A tier stores opaque KV blocks keyed by their chained `block_hash` (DESIGN.md §5). G1 (device)
is the engine's own pool; kvbm implements G2 (host memory) and G3 (local disk) behind the
`StorageTier` protocol, plus `SimTier` (accounting only) for the mocker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from tandem.config_check import check_range

TierName = Literal["device", "host", "disk"]
TIER_NAMES: tuple[TierName, ...] = ("device", "host", "disk")
GIB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockMeta:
    """What a KV event needs to describe a block: its hash and parent (which the router keys on)
    and, for consumers that re-hash (opt-in on the mocker: --kv-events-token-ids), its token ids."""

    block_size: int
    token_ids: tuple[int, ...] = ()
    parent_hash: int | None = None
    lora_name: str | None = None


class StorageTier(Protocol):
    """One tier of KV blocks with LRU eviction and fixed-size slots.

    Implementations are NOT thread-safe: the owner (`BlockManager`) serialises calls per tier.
    `data` is any contiguous buffer (bytes, bytearray, memoryview, numpy uint8 array) of at
    most `block_bytes` bytes.
    """

    name: TierName

    @property
    def capacity_blocks(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    def put(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> list[int]:
        """Store (or refresh) a block as most recently used; return hashes evicted to make
        room (LRU first). Raises ValueError when `data` is larger than `block_bytes`."""
        ...

    def get(self, block_hash: int) -> bytes | None:
        """A copy of the block's data and mark it most recently used; None on a miss.
        A block that fails its integrity check is dropped and reported as a miss."""
        ...

    def meta(self, block_hash: int) -> BlockMeta | None:
        """The metadata stored with the block (no LRU touch)."""
        ...

    def contains(self, block_hash: int) -> bool:
        """Presence test without touching the LRU order."""
        ...

    def remove(self, block_hash: int) -> bool:
        """Drop a block; False when it was absent."""
        ...

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are present (stops at the first miss)."""
        ...

    def block_hashes(self) -> list[int]:
        """Every stored hash, least recently used first (no LRU touch)."""
        ...

    def clear(self) -> list[int]:
        """Drop every block; return their hashes."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError when internal accounting is inconsistent."""
        ...


def _capacity(gb: float, blocks: int, slot_bytes: int) -> int:
    if blocks:
        return blocks
    return int(gb * GIB) // slot_bytes if gb and slot_bytes else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class KvbmConfig:
    """Sizes and policies of the host and disk tiers.

    Capacity is given either in GB (`*_gb`, needs `block_bytes`) or in blocks (`*_blocks`),
    not both; 0 everywhere disables the tier. The disk tier is fed from the host tier, so it
    needs one. `disk_min_reuse` is the G2→G3 frequency filter: a block is written to disk once
    it was reused (onboarded or offloaded again) at least that many times; 0 = no filter.
    `block_bytes` is the size of one block's KV (all layers); the engine fills it in at start
    with `dataclasses.replace` when flags gave GB.
    """

    host_gb: float = 0.0
    host_blocks: int = 0
    disk_dir: str | None = None
    disk_gb: float = 0.0
    disk_blocks: int = 0
    disk_min_reuse: int = 1
    disk_direct_io: bool = True
    offload_queue_size: int = 256
    disk_queue_size: int = 64
    block_bytes: int = 0
    hit_rate_window_s: float = 60.0
    log_interval_s: float = 30.0
    host_bandwidth_gbps: float = 20.0  # simulation only (SimBlockManager)
    disk_bandwidth_gbps: float = 2.0  # simulation only

    def __post_init__(self) -> None:
        check_range("host_gb", self.host_gb, low=0.0)
        check_range("disk_gb", self.disk_gb, low=0.0)
        check_range("host_blocks", self.host_blocks, low=0)
        check_range("disk_blocks", self.disk_blocks, low=0)
        check_range("disk_min_reuse", self.disk_min_reuse, low=0)
        check_range("block_bytes", self.block_bytes, low=0)
        check_range("offload_queue_size", self.offload_queue_size, low=1)
        check_range("disk_queue_size", self.disk_queue_size, low=1)
        check_range("hit_rate_window_s", self.hit_rate_window_s, low=0.001)
        check_range("log_interval_s", self.log_interval_s, low=0.0)
        check_range("host_bandwidth_gbps", self.host_bandwidth_gbps, low=1e-6)
        check_range("disk_bandwidth_gbps", self.disk_bandwidth_gbps, low=1e-6)
        for tier, gb, blocks in (("host", self.host_gb, self.host_blocks),
                                 ("disk", self.disk_gb, self.disk_blocks)):  # fmt: skip
            if gb and blocks:
                raise ValueError(
                    f"{tier}_gb and {tier}_blocks both set; expected one capacity for {tier}"
                )
        if (self.disk_gb or self.disk_blocks) and not self.disk_dir:
            raise ValueError("disk capacity set but disk_dir=None; expected a directory")
        if self.disk_dir and not (self.disk_gb or self.disk_blocks):
            raise ValueError(f"disk_dir={self.disk_dir!r} set without disk_gb or disk_blocks")
        if self.has_disk and not self.has_host:
            raise ValueError("disk tier set without a host tier; G3 is fed from G2")

    @property
    def has_host(self) -> bool:
        return bool(self.host_gb or self.host_blocks)

    @property
    def has_disk(self) -> bool:
        return bool(self.disk_dir and (self.disk_gb or self.disk_blocks))

    def host_capacity_blocks(self, slot_bytes: int | None = None) -> int:
        """Blocks in G2; GB capacity is divided by `slot_bytes` (default `block_bytes`)."""
        return self._resolve("host", self.host_gb, self.host_blocks, slot_bytes)

    def disk_capacity_blocks(self, slot_bytes: int | None = None) -> int:
        """Blocks in G3; GB capacity is divided by the on-disk size of one block file."""
        return self._resolve("disk", self.disk_gb, self.disk_blocks, slot_bytes)

    def _resolve(self, tier: str, gb: float, blocks: int, slot_bytes: int | None) -> int:
        slot = self.block_bytes if slot_bytes is None else slot_bytes
        if gb and not slot:
            raise ValueError(f"{tier}_gb={gb} needs block_bytes > 0 to count blocks")
        capacity = _capacity(gb, blocks, slot)
        if (gb or blocks) and capacity < 1:
            raise ValueError(f"{tier}_gb={gb} holds no block of {slot} bytes; expected more")
        return capacity
