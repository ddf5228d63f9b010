"""`LruIndex`: block_hash → entry in least-recently-used order, bounded by a capacity.

The bookkeeping every tier shares (host slots, disk files, simulated blocks). Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

E = TypeVar("E")


class LruIndex(Generic[E]):
    """Entries ordered from least to most recently used; never more than `capacity`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} out of range; expected >= 1")
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
