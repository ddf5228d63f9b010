"""G2: KV blocks in one preallocated host buffer cut into fixed-size slots, LRU eviction.

The buffer is CUDA-pinned (page-locked, fast DMA) when torch is already loaded with CUDA,
else an anonymous shared mmap (page-aligned, inherited by forked children, committed lazily
by the OS so a large `--kvbm-host-gb` costs nothing until used).
"""

from __future__ import annotations

import logging
import mmap
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.config_check import check_range
from tandem.kvbm.base import BlockMeta, TierName
from tandem.kvbm.lru import LruTier, TierEntry

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _Slot(TierEntry):
    index: int


def allocate_host_buffer(num_bytes: int) -> tuple[np.ndarray, Any]:
    """A uint8 array of `num_bytes` and the object owning its memory (keep it alive)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        try:
            owner = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
            return owner.numpy(), owner
        except RuntimeError as exc:  # pinning can fail under a low memlock limit
            logger.warning("pinned host buffer of %d bytes failed (%s); using mmap", num_bytes, exc)
    owner = mmap.mmap(-1, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    return np.frombuffer(owner, dtype=np.uint8), owner


class HostTier(LruTier[_Slot]):
    """`StorageTier` over host memory: `capacity_blocks` slots of `block_bytes` each.

    A slot holds one block; `put` of a present hash only refreshes its LRU position (the same
    chained hash means the same tokens, hence the same KV). Not thread-safe.
    """

    name: TierName = "host"

    def __init__(self, *, capacity_blocks: int, block_bytes: int) -> None:
        check_range("block_bytes", block_bytes, low=1)
        super().__init__(capacity_blocks=capacity_blocks, block_bytes=block_bytes)
        self._buffer, self._owner = allocate_host_buffer(capacity_blocks * block_bytes)
        self._free = list(range(capacity_blocks - 1, -1, -1))
        logger.info(
            "host tier: %d blocks x %d bytes (%.2f GiB, %s)",
            capacity_blocks,
            block_bytes,
            capacity_blocks * block_bytes / (1 << 30),
            type(self._owner).__name__,
        )

    def put(self, block_hash: int, data: memoryview | bytes, meta: BlockMeta) -> list[int]:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size > self._block_bytes:
            raise ValueError(f"block of {src.size} bytes exceeds block_bytes={self._block_bytes}")
        if self._index.touch(block_hash) is not None:
            return []
        evicted = self._make_room()
        slot = self._free.pop()
        start = slot * self._block_bytes
        self._buffer[start : start + src.size] = src
        self._index.insert(block_hash, _Slot(index=slot, num_bytes=int(src.size), meta=meta))
        return evicted

    def get(self, block_hash: int) -> bytes | None:
        slot = self._index.touch(block_hash)
        if slot is None:
            return None
        start = slot.index * self._block_bytes
        return self._buffer[start : start + slot.num_bytes].tobytes()

    def clear(self) -> list[int]:
        hashes = self._index.clear()
        self._free = list(range(self.capacity_blocks - 1, -1, -1))
        return hashes

    def check_integrity(self) -> None:
        used = [slot.index for _, slot in self._index.items()]
        assert len(used) <= self.capacity_blocks, f"{len(used)} blocks > capacity"
        assert len(set(used)) == len(used), "two blocks share a slot"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert not set(used) & set(self._free), "a used slot is also free"
        assert len(used) + len(self._free) == self.capacity_blocks, (
            f"slots leaked: {len(used)} used + {len(self._free)} free != {self.capacity_blocks}"
        )
        assert all(0 <= i < self.capacity_blocks for i in used + self._free), "slot out of range"
        assert all(s.num_bytes <= self._block_bytes for _, s in self._index.items())

    def _release(self, block_hash: int, entry: _Slot) -> None:
        self._free.append(entry.index)
