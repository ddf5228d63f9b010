"""`ReuseCounter`: how often each block came back, for the G2 → G3 frequency filter.

Only blocks that are reused write to disk; one-off prompts stay in host memory and age out.
"""

from __future__ import annotations

from collections import OrderedDict

from tandem.config_check import check_range


class ReuseCounter:
    """Counts uses per block_hash (offloaded or onboarded); remembers the `max_entries` most
    recently used hashes so memory stays bounded. Not thread-safe."""

    def __init__(self, *, min_reuse: int, max_entries: int) -> None:
        check_range("min_reuse", min_reuse, low=0)
        check_range("max_entries", max_entries, low=1)
        self.min_reuse = min_reuse
        self._max_entries = max_entries
        self._uses: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._uses)

    def note_use(self, block_hash: int) -> bool:
        """Count one use; True when the block has now been reused (uses − 1) at least
        `min_reuse` times, i.e. it qualifies for disk. `min_reuse=0` passes every block."""
        uses = self._uses.pop(block_hash, 0) + 1
        self._uses[block_hash] = uses
        if len(self._uses) > self._max_entries:
            self._uses.popitem(last=False)
        return uses - 1 >= self.min_reuse

    def reuses(self, block_hash: int) -> int:
        return max(self._uses.get(block_hash, 0) - 1, 0)
