"""Paged KV blocks with prefix reuse, reference counts and LRU eviction (DESIGN.md §5, §6).

A block is free (no hash, unreferenced), cached-evictable (hashed, unreferenced, in LRU
order) or in use (referenced by ≥ 1 sequence; hashed once it is full and computed). Cached
blocks are found by their chained sequence hash. The pool records the KV events it causes:
`BlockStored` for each newly cached block (a block whose hash was already cached is a
duplicate and stays uncached, with no event), `BlockRemoved` when an evictable block is
reused. With `record_evictions` (simulated kvbm tiers behind the pool) each evicted block's
hash and metadata is also kept until `take_evicted()`. Synchronous and not thread-safe.

`keep_token_ids=False` keeps no tokens: `BlockStored` events, snapshots and evicted blocks
then carry no token ids (no consumer of the mocker's events needs them: routers key on the
block hashes), which saves copying every prompt token for long prompts.

`BlockPool` is the contract; `PyBlockPool` below is the pool in Python and the reference of
the C pool (`c_block_pool.CBlockPool`: the state in C arrays, whole arrays per call): the two
hand out the same blocks and record the same events, step for step.
`c_block_pool.new_block_pool(...)` builds the C pool where it loads, else a `PyBlockPool`.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tandem.protocols.kv_events import BlockRemoved, BlockStored, KvEvent


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    lora_name: str | None = None


class EvictedBlock(NamedTuple):
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    lora_name: str | None


class BlockPool:
    """The pool's contract and the parts both implementations share (events, token array).
    Build one with `c_block_pool.new_block_pool`: the C pool where it loads, else Python's."""

    def __init__(self, num_blocks: int, block_size: int, *, keep_token_ids: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # token ids of every block, allocated up front like a real engine's KV pool: the
        # prefix cache filling up costs no memory (a tuple of Python ints per block was
        # ~2.3 KB at block_size 64, tens of MB over a long soak)
        self._tokens = array("q", bytes(8 * num_blocks * block_size)) if keep_token_ids else None
        self._events: list[KvEvent] = []
        self.record_evictions = False
        self._evicted: list[EvictedBlock] = []

    @property
    def num_active_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        raise NotImplementedError

    @property
    def num_allocatable_blocks(self) -> int:
        """Free blocks plus cached blocks nobody references (evicted on demand)."""
        raise NotImplementedError

    @property
    def num_cached_blocks(self) -> int:
        raise NotImplementedError

    @property
    def usage(self) -> float:
        return self.num_active_blocks / self.num_blocks

    @property
    def keeps_token_ids(self) -> bool:
        return self._tokens is not None

    def block_tokens(self, block_id: int) -> list[int]:
        """The token ids of a cached block ([] without `keep_token_ids`)."""
        if self._tokens is None:
            return []
        start = block_id * self.block_size
        return self._tokens[start : start + self.block_size].tolist()

    def ref_count(self, block_id: int) -> int:
        raise NotImplementedError

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (no state change)."""
        raise NotImplementedError

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each (cached) block, taking it out of the LRU."""
        raise NotImplementedError

    def allocate(self, num: int) -> list[int] | None:
        """`num` fresh blocks with one reference each, evicting the least recently used
        cached blocks if needed; None (nothing changes) if fewer than `num` are available."""
        raise NotImplementedError

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> None:
        """Mark newly computed full blocks as cached. `token_ids` holds their tokens
        (len = len(block_ids) × block_size); `parent_hash` is the hash before the first one.
        Emits one BlockStored per run of newly cached consecutive blocks."""
        raise NotImplementedError

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Released in reverse, so a sequence's tail
        blocks are the first evicted and its shared prefix stays cached longest."""
        raise NotImplementedError

    def snapshot(self) -> list[KvEvent]:
        """BlockStored events for every cached block, parents before children, one event
        per chain segment (a run of blocks each the parent of the next)."""
        raise NotImplementedError

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is in exactly one state (free, evictable,
        in use), the hash index matches the blocks and the counters add up."""
        raise NotImplementedError

    def take_evicted(self) -> list[EvictedBlock]:
        """Blocks evicted since the last call (with `record_evictions`), oldest first."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def drain_events(self) -> list[KvEvent]:
        """KV events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _flush_run(
        self,
        block_hashes: Sequence[int],
        start: int,
        end: int,
        parent: int | None,
        token_ids: Sequence[int],
        lora: str | None,
    ) -> None:
        """One BlockStored for `block_hashes[start:end]` (nothing if empty)."""
        if end > start:
            size = self.block_size
            tokens = list(token_ids[start * size : end * size]) if self._tokens is not None else []
            self._flush_run_into(self._events, list(block_hashes[start:end]), parent, tokens, lora)

    def _flush_run_into(
        self,
        events: list[KvEvent],
        run: list[int],
        parent: int | None,
        tokens: list[int],
        lora: str | None,
    ) -> None:
        events.append(
            BlockStored(
                block_hashes=run,
                parent_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_name=lora,
            )
        )

    def _snapshot_of(
        self,
        cached: dict[int, int],
        parent_of: dict[int, int | None],
        lora_of: dict[int, str | None],
    ) -> list[KvEvent]:
        """The snapshot's events from the hash index (`cached`, in caching order) and each
        cached block's parent hash and LoRA name (keyed by block id)."""
        children: dict[int, list[int]] = {}
        roots: list[int] = []
        for h, block_id in cached.items():
            parent = parent_of[block_id]
            if parent is not None and parent in cached:
                children.setdefault(parent, []).append(h)
            else:
                roots.append(h)
        events: list[KvEvent] = []
        stack = [(h, parent_of[cached[h]]) for h in reversed(roots)]
        while stack:
            h, parent = stack.pop()
            run = [h]
            while kids := children.get(run[-1]):
                stack.extend((k, run[-1]) for k in reversed(kids[1:]))
                run.append(kids[0])
            tokens = [t for x in run for t in self.block_tokens(cached[x])]
            self._flush_run_into(events, run, parent, tokens, lora_of[cached[run[0]]])
        return events


class PyBlockPool(BlockPool):
    """The pool in Python: the fallback without a C compiler and the C pool's reference."""

    def __init__(self, num_blocks: int, block_size: int, *, keep_token_ids: bool = True) -> None:
        super().__init__(num_blocks, block_size, keep_token_ids=keep_token_ids)
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._num_active = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_active_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._num_active

    @property
    def num_allocatable_blocks(self) -> int:
        """Free blocks plus cached blocks nobody references (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (no state change)."""
        out: list[int] = []
        for h in block_hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    # ------------------------------------------------------------------ mutations
    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each (cached) block, taking it out of the LRU."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                assert block.block_hash is not None, "acquiring a free block"
                del self._evictable[block_id]
                self._num_active += 1
            block.ref_count += 1

    def allocate(self, num: int) -> list[int] | None:
        """`num` fresh blocks with one reference each, evicting the least recently used
        cached blocks if needed; None (nothing changes) if fewer than `num` are available."""
        if num > self.num_allocatable_blocks:
            return None
        blocks, free = self._blocks, self._free
        take = min(num, len(free))
        out = [free.popleft() for _ in range(take)]
        for block_id in out:
            blocks[block_id].ref_count = 1
        if take < num:  # evict the least recently used cached blocks, oldest first
            popitem, cached = self._evictable.popitem, self._cached
            evicted = [popitem(last=False)[0] for _ in range(num - take)]
            victims = [blocks[block_id] for block_id in evicted]
            # evictable blocks are cached, so hashed (check_integrity holds it)
            removed: list[int] = [block.block_hash for block in victims]  # type: ignore[misc]
            if self.record_evictions:
                self._evicted += [
                    EvictedBlock(h, b.parent_hash, tuple(self.block_tokens(i)), b.lora_name)
                    for h, b, i in zip(removed, victims, evicted, strict=True)
                ]
            for h in removed:
                del cached[h]
            for block in victims:  # parent/lora are read only while a block is cached
                block.block_hash = None
                block.ref_count = 1
            out += evicted
            self._events.append(BlockRemoved(block_hashes=removed))
        self._num_active += num
        return out

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> None:
        size, blocks, cached, tokens = self.block_size, self._blocks, self._cached, self._tokens
        run_start, run_parent = 0, parent_hash  # the current run: block_hashes[run_start:i]
        prev = parent_hash
        for i, (block_id, h) in enumerate(zip(block_ids, block_hashes, strict=True)):
            block = blocks[block_id]
            assert block.ref_count > 0 and block.block_hash is None, "caching a bad block"
            if h in cached:  # computed twice concurrently: keep the first copy only
                self._flush_run(block_hashes, run_start, i, run_parent, token_ids, lora_name)
                run_start, run_parent = i + 1, h
            else:
                block.block_hash, block.parent_hash, block.lora_name = h, prev, lora_name
                cached[h] = block_id
                if tokens is not None:
                    start = block_id * size
                    tokens[start : start + size] = array("q", token_ids[i * size : (i + 1) * size])
            prev = h
        self._flush_run(
            block_hashes, run_start, len(block_hashes), run_parent, token_ids, lora_name
        )

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Released in reverse, so a sequence's tail
        blocks are the first evicted and its shared prefix stays cached longest."""
        blocks, free, evictable = self._blocks, self._free, self._evictable
        unused = 0
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if not block.ref_count:
                unused += 1
                if block.block_hash is None:
                    free.append(block_id)
                else:
                    evictable[block_id] = None
        self._num_active -= unused

    # ------------------------------------------------------------------ snapshot / checks
    def snapshot(self) -> list[KvEvent]:
        """BlockStored events for every cached block, parents before children, one event
        per chain segment (a run of blocks each the parent of the next)."""
        blocks = self._blocks
        return self._snapshot_of(
            self._cached,
            {b: blocks[b].parent_hash for b in self._cached.values()},
            {b: blocks[b].lora_name for b in self._cached.values()},
        )

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is in exactly one state (free, evictable,
        in use), the hash index matches the blocks and the counters add up."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        evictable = set(self._evictable)
        if free & evictable:
            raise AssertionError(f"blocks both free and evictable: {sorted(free & evictable)}")
        num_active = 0
        for block_id, block in enumerate(self._blocks):
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} has ref_count {block.ref_count}")
            if block.ref_count > 0:
                num_active += 1
                if block_id in free or block_id in evictable:
                    raise AssertionError(f"block {block_id} is in use and listed as unused")
            elif block.block_hash is None and block_id not in free:
                raise AssertionError(f"block {block_id} leaked: unreferenced, not free")
            elif block.block_hash is not None and block_id not in evictable:
                raise AssertionError(f"cached block {block_id} leaked: not in the LRU")
            if block.block_hash is not None and self._cached.get(block.block_hash) != block_id:
                raise AssertionError(f"block {block_id} hash missing from the index")
        if num_active != self._num_active:
            raise AssertionError(f"num_active={self._num_active}, counted {num_active}")
        if len(self._cached) != sum(b.block_hash is not None for b in self._blocks):
            raise AssertionError("hash index names blocks that are not cached")
