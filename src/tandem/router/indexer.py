"""`KvIndexer`: which worker (and DP rank) holds which KV block, by chained block hash.

Layout, chosen for speed in pure Python: per tier a dict `block_hash -> bitmask of worker
slots`, plus per slot the set of hashes it holds (for removal of a whole worker and for
integrity checks). Engine-native hashes (vLLM) are kept per slot as lookup keys mapping to
tandem's hashes.

Where the time goes: a lookup in a dict of ~10^5..10^6 blocks costs a few cache misses, and
that, not bytecode, bounds `find_matches`. So it looks masks up with one `map` and measures
runs of equal masks with `list.count` (a Python step per run, not per block), and equal masks
are interned (one object per value, kept by the mutators), which turns those comparisons
into identity checks on an object already in cache.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import or_
from typing import NamedTuple

MEDIA = ("device", "host", "disk", "remote")
_MIN_INTERN_SWEEP = 4096


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
        # mask value -> the one object standing for it in `_holders` (see module docstring)
        self._intern: dict[int, int] = {}
        self._bits: list[int] = []  # per slot its mask alone, the interned object
        self._intern_sweep_at = _MIN_INTERN_SWEEP

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
            bit = 1 << slot
            self._bits.append(self._intern.setdefault(bit, bit))
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
        bit = self._bits[slot]
        held = self._blocks[slot][medium]
        holders = self._holders[medium]
        get = holders.get
        intern = self._intern.setdefault
        old: int | None = None  # a chain's masks come in runs of one object:
        new = 0  # OR and intern once per run
        for h in block_hashes:
            if h not in held:
                held.add(h)
                mask = get(h)
                if mask is None:
                    holders[h] = bit
                elif mask is old:
                    holders[h] = new
                else:
                    old = mask
                    mask |= bit
                    holders[h] = new = intern(mask, mask)
        if engine_hashes:
            self._engine_map[slot].update(zip(engine_hashes, block_hashes, strict=False))
        if len(self._intern) > self._intern_sweep_at:
            self._sweep_intern()

    def remove(self, key: WorkerKey, block_hashes: Iterable[int], medium: str = "device") -> int:
        """Drop blocks (tandem hashes or the worker's engine hashes); returns blocks dropped."""
        slot = self._slot_of.get(key)
        if slot is None:
            return 0
        bit = self._bits[slot]
        held = self._blocks[slot][medium]
        holders = self._holders[medium]
        aliases = self._engine_map[slot]
        intern = self._intern.setdefault
        old: int | None = None  # as in `store`
        new = 0
        dropped = 0
        for h in block_hashes:
            if aliases:
                h = aliases.pop(h, h)
            if h in held:
                held.discard(h)
                mask = holders[h]
                if mask is bit or mask == bit:
                    del holders[h]
                elif mask is old:
                    holders[h] = new
                else:
                    old = mask
                    mask ^= bit
                    holders[h] = new = intern(mask, mask)
                dropped += 1
        return dropped

    def _sweep_intern(self) -> None:
        """Forget interned masks nothing else refers to. Only speed depends on `_intern`:
        a live mask dropped here still compares equal, just not identical."""
        intern = self._intern
        probe = int("-" + "9" * 30)  # a fresh object, then referenced as a dead entry is
        intern[probe] = probe
        del probe
        masks = list(intern)
        counts = list(map(sys.getrefcount, masks))
        dead = counts[-1]
        for mask, count in zip(masks, counts, strict=True):
            if count <= dead:
                del intern[mask]
        self._intern_sweep_at = max(_MIN_INTERN_SWEEP, 2 * len(intern))

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
        `block_hashes` it holds (on any of `media`). Workers with depth 0 are absent.

        Exact for any contents (no assumption that a worker's blocks are prefix-closed);
        that assumption only picks how far to look up masks, never the answer."""
        n = len(block_hashes)
        if not n:
            return {}
        lookup, masks_of = self._mask_readers(media)
        if not lookup(block_hashes[0]):
            return {}
        if n > 8 and not lookup(block_hashes[-1]):
            # The walk ends at the first miss. Bisect for *a* miss assuming prefix closure;
            # whatever the truth, the first miss is at or before it, so looking up to it is
            # enough (a real request's uncached tail is not looked up block by block).
            lo, hi = 0, n - 1
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if lookup(block_hashes[mid]):
                    lo = mid
                else:
                    hi = mid
            block_hashes = block_hashes[:hi]  # block `hi` is a miss: the walk ends there
        return self._walk(masks_of(block_hashes))

    def _mask_readers(
        self, media: Sequence[str]
    ) -> tuple[Callable[[int], int | None], Callable[[Sequence[int]], list[int | None]]]:
        """(mask of one block, masks of many blocks); a miss reads as 0 or None."""
        if len(media) == 1:
            get = self._holders[media[0]].get
            return get, lambda hashes: list(map(get, hashes))
        gets = [self._holders[m].get for m in media]

        def lookup(h: int) -> int:
            mask = 0
            for g in gets:
                mask |= g(h, 0)
            return mask

        def masks_of(hashes: Sequence[int]) -> list[int | None]:
            masks: Iterable[int] = map(gets[0], hashes, repeat(0))
            for g in gets[1:]:
                masks = map(or_, masks, map(g, hashes, repeat(0)))
            return list(masks)

        return lookup, masks_of

    def _walk(self, masks: list[int | None]) -> dict[WorkerKey, int]:
        """Depths from per-block masks (`masks[0]` non-empty): a worker's depth is the first
        block whose mask lacks it. The running AND only changes where a value appears for
        the first time, and a chain's masks come in a few long runs of one interned object,
        so runs are measured with `list.count` and a Python step is taken per run."""
        out: dict[WorkerKey, int] = {}
        n = len(masks)
        mask = masks[0]
        assert mask, "the caller checked the first block"
        p = 0
        while True:
            rest = masks[p:] if p else masks
            value = rest[0]
            count = rest.count(value)
            if count != len(rest) and rest[:count].count(value) != count:
                return self._walk_slow(masks, p, mask, out)  # `value` recurs after a gap
            if value is not mask:
                m = mask & value if value else 0
                if m != mask:
                    self._record(mask ^ m, p, out)
                    if not m:
                        return out
                    mask = m
            p += count
            if p == n:
                self._record(mask, n, out)
                return out

    def _walk_slow(
        self, masks: list[int | None], p: int, mask: int, out: dict[WorkerKey, int]
    ) -> dict[WorkerKey, int]:
        """`_walk` from block `p` (running mask `mask`) one block at a time."""
        for depth in range(p, len(masks)):
            value = masks[depth]
            m = mask & value if value else 0
            if m != mask:
                self._record(mask ^ m, depth, out)
                if not m:
                    return out
                mask = m
        self._record(mask, len(masks), out)
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
            for h, mask in holders.items():  # a speed invariant: masks are the interned objects
                assert self._intern.get(mask) is mask, f"mask of {h:#x} is not interned"
