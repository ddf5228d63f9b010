"""`LruIndex`: block_hash → entry in least-recently-used order, bounded by a capacity;
`LruTier`: the `StorageTier` bookkeeping every tier shares (host slots, disk files, simulated
blocks) over one. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tandem.config_check import check_range
from tandem.kvbm.base import BlockMeta

E = TypeVar("E")


class LruIndex(Generic[E]):
    """Entries ordered from least to most recently used; never more than `capacity`."""

    def __init__(self, capacity: int) -> None:
        check_range("capacity", capacity, low=1)
        self.capacity = capacity
        self._entries: OrderedDict[int, E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __iter__(self) -> Iterator[int]:
        """Hashes from least to most recently used."""
        return iter(list(self._entries))

    @property
    def is_full(self) -> bool:
        return len(self._entries) >= self.capacity

    def peek(self, block_hash: int) -> E | None:
        return self._entries.get(block_hash)

    def touch(self, block_hash: int) -> E | None:
        """The entry, now most recently used; None when absent."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
        return entry

    def insert(self, block_hash: int, entry: E) -> None:
        """Add a new entry as most recently used; the caller made room first."""
        assert block_hash not in self._entries, f"block_hash={block_hash:#x} already present"
        assert not self.is_full, "insert into a full LruIndex; evict first"
        self._entries[block_hash] = entry

    def pop(self, block_hash: int) -> E | None:
        return self._entries.pop(block_hash, None)

    def pop_lru(self) -> tuple[int, E]:
        """Remove and return the least recently used entry (KeyError when empty)."""
        return self._entries.popitem(last=False)

    def leading(self, block_hashes: Sequence[int]) -> int:
        """How many leading hashes are present."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self._entries:
                return i
        return len(block_hashes)

    def items(self) -> list[tuple[int, E]]:
        return list(self._entries.items())

    def clear(self) -> list[int]:
        hashes = list(self._entries)
        self._entries.clear()
        return hashes


@dataclass(slots=True)
class TierEntry:
    """What a tier keeps per block besides its data."""

    num_bytes: int
    meta: BlockMeta


EntryT = TypeVar("EntryT", bound=TierEntry)


class LruTier(Generic[EntryT]):
    """The `StorageTier` accessors every tier shares, over an `LruIndex` of `TierEntry`s.

    A subclass stores the data (`put`, `get`, `clear`, `check_integrity`) and frees what an
    entry holds in `_release`, which `remove` and `_make_room` call once the entry has left the
    index. Not thread-safe.
    """

    def __init__(self, *, capacity_blocks: int, block_bytes: int) -> None:
        self._block_bytes = block_bytes
        self._index: LruIndex[EntryT] = LruIndex(capacity_blocks)

    @property
    def capacity_blocks(self) -> int:
        return self._index.capacity

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def meta(self, block_hash: int) -> BlockMeta | None:
        entry = self._index.peek(block_hash)
        return None if entry is None else entry.meta

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._index

    def remove(self, block_hash: int) -> bool:
        entry = self._index.pop(block_hash)
        if entry is None:
            return False
        self._release(block_hash, entry)
        return True

    def lookup(self, block_hashes: Sequence[int]) -> int:
        return self._index.leading(block_hashes)

    def block_hashes(self) -> list[int]:
        return list(self._index)

    def _make_room(self) -> list[int]:
        """Evict least recently used blocks until one more fits; their hashes, LRU first."""
        evicted = []
        while self._index.is_full:
            block_hash, entry = self._index.pop_lru()
            self._release(block_hash, entry)
            evicted.append(block_hash)
        return evicted

    def _release(self, block_hash: int, entry: EntryT) -> None:
        """Free what `entry` held (a slot, a file); it has already left the index."""
