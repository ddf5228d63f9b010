"""`KvIndexer`: which worker (and DP rank) holds which KV block, by chained block hash.

Layout, chosen for speed in pure Python: per tier a dict `block_hash -> bitmask of worker
slots`, plus per slot the set of hashes it holds (for removal of a whole worker and for
integrity checks). A prefix walk is then one dict lookup and one int AND per block.
Engine-native hashes (vLLM) are kept per slot as lookup keys mapping to tandem's hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

MEDIA = ("device", "host", "disk", "remote")


class WorkerKey(NamedTuple):
    worker_id: str
    dp_rank: int = 0


class KvIndexer:
    """Synchronous and deterministic; not thread-safe. All mutators are idempotent per block:
    storing a held block or removing an absent one changes nothing."""

    def __init__(self) -> None:
        self._holders: dict[str, dict[int, int]] = {m: {} for m in MEDIA}
        self._slot_of: dict[WorkerKey, int] = {}
        self._keys: list[WorkerKey | None] = []
        self._free_slots: list[int] = []
        self._blocks: list[dict[str, set[int]]] = []
        self._engine_map: list[dict[int, int]] = []

    # ------------------------------------------------------------ workers
    def _slot(self, key: WorkerKey) -> int:
        slot = self._slot_of.get(key)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = min(self._free_slots)  # lowest free keeps masks small
            self._free_slots.remove(slot)
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            self._keys.append(key)
            self._blocks.append({})
            self._engine_map.append({})
        self._blocks[slot] = {m: set() for m in MEDIA}
        self._engine_map[slot] = {}
        self._slot_of[key] = slot
        return slot

    @property
    def workers(self) -> list[WorkerKey]:
        return sorted(self._slot_of)

    def remove_worker(self, worker_id: str) -> int:
        """Forget every block of every DP rank of `worker_id`; returns blocks dropped."""
        dropped = 0
        for key in [k for k in self._slot_of if k.worker_id == worker_id]:
            dropped += self.clear(key)
            slot = self._slot_of.pop(key)
            self._keys[slot] = None
            self._free_slots.append(slot)
        return dropped

    # ------------------------------------------------------------ mutations
    def store(
        self,
        key: WorkerKey,
        block_hashes: Sequence[int],
        medium: str = "device",
        engine_hashes: Sequence[int] | None = None,
    ) -> None:
        """Record `block_hashes` as held by `key` on `medium`; `engine_hashes` (same length)
        become aliases for later removals."""
        slot = self._slot(key)
        bit = 1 << slot
        held = self._blocks[slot][medium]
        holders = self._holders[medium]
        get = holders.get
        for h in block_hashes:
            if h not in held:
                held.add(h)
                holders[h] = get(h, 0) | bit
        if engine_hashes:
            self._engine_map[slot].update(zip(engine_hashes, block_hashes, strict=False))

    def remove(self, key: WorkerKey, block_hashes: Iterable[int], medium: str = "device") -> int:
        """Drop blocks (tandem hashes or the worker's engine hashes); returns blocks dropped."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0
        bit = 1 << slot
        held = self._blocks[slot][medium]
        holders = self._holders[medium]
        aliases = self._engine_map[slot]
        dropped = 0
        for h in block_hashes:
            if aliases:
                h = aliases.pop(h, h)
            if h in held:
                held.discard(h)
                mask = holders[h] ^ bit
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]
                dropped += 1
        return dropped

    def clear(self, key: WorkerKey, medium: str | None = None) -> int:
        """Drop all blocks of `key` (on one medium, or all); returns blocks dropped."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0
        dropped = 0
        for m in MEDIA if medium is None else (medium,):
            held = list(self._blocks[slot][m])
            dropped += self.remove(key, held, m) if held else 0
        if medium is None:
            self._engine_map[slot].clear()
        return dropped

    def resolve(self, key: WorkerKey, engine_hash: int) -> int | None:
        """tandem's hash for one of `key`'s engine hashes, if known."""
        slot = self._slot_of.get(key)
        return None if slot is None else self._engine_map[slot].get(engine_hash)

    # ------------------------------------------------------------ queries
    def find_matches(
        self, block_hashes: Sequence[int], media: Sequence[str] = ("device",)
    ) -> dict[WorkerKey, int]:
        """For every worker holding the first block: how many leading blocks of
        `block_hashes` it holds (on any of `media`). Workers with depth 0 are absent."""
        if not block_hashes:
            return {}
        get: Callable[[int, int], int]
        if len(media) == 1:
            get = self._holders[media[0]].get
        else:
            tiers = [self._holders[m].get for m in media]

            def get(h: int, default: int = 0) -> int:
                mask = default
                for g in tiers:
                    mask |= g(h, 0)
                return mask

        mask = get(block_hashes[0], 0)
        out: dict[WorkerKey, int] = {}
        if not mask:
            return out
        depth = 1
        for i in range(1, len(block_hashes)):
            m = mask & get(block_hashes[i], 0)
            if m != mask:
                self._record(mask ^ m, depth, out)
                if not m:
                    return out
                mask = m
            depth += 1
        self._record(mask, depth, out)
        return out

    def _record(self, bits: int, depth: int, out: dict[WorkerKey, int]) -> None:
        keys = self._keys
        while bits:
            low = bits & -bits
            key = keys[low.bit_length() - 1]
            assert key is not None, "a live bit points at a freed slot"
            out[key] = depth
            bits ^= low

    def has_tiers(self) -> bool:
        """Whether any block is held on a medium other than device."""
        return any(self._holders[m] for m in MEDIA[1:])

    def num_blocks(self, key: WorkerKey, medium: str = "device") -> int:
        slot = self._slot_of.get(key)
        return 0 if slot is None else len(self._blocks[slot][medium])

    def holds(self, key: WorkerKey, block_hash: int, medium: str = "device") -> bool:
        slot = self._slot_of.get(key)
        return slot is not None and block_hash in self._blocks[slot][medium]

    def snapshot(self) -> dict[WorkerKey, dict[str, frozenset[int]]]:
        """Every worker's blocks per medium (tests compare two indexers with this)."""
        return {
            key: {m: frozenset(s) for m, s in self._blocks[slot].items() if s}
            for key, slot in self._slot_of.items()
            if any(self._blocks[slot].values())
        }

    def check_integrity(self) -> None:
        """Raise AssertionError if the per-hash masks and per-slot sets disagree."""
        for key, slot in self._slot_of.items():
            assert self._keys[slot] == key, f"slot {slot} maps to {self._keys[slot]}, not {key}"
        live = {slot for slot in self._slot_of.values()}
        for medium, holders in self._holders.items():
            for h, mask in holders.items():
                assert mask, f"empty mask kept for block {h:#x} on {medium}"
                bits = mask
                while bits:
                    low = bits & -bits
                    slot = low.bit_length() - 1
                    assert slot in live, f"block {h:#x} held by freed slot {slot}"
                    assert h in self._blocks[slot][medium], f"slot {slot} lacks block {h:#x}"
                    bits ^= low
            for slot in live:
                for h in self._blocks[slot][medium]:
                    assert holders.get(h, 0) >> slot & 1, f"mask of {h:#x} misses slot {slot}"
