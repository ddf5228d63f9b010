"""Fixed-size KV blocks: allocation, ref-counted sharing, prefix caching, LRU eviction.

A block is free (ref 0) or used (ref > 0). Free blocks that hold a full, hashed block stay
in the prefix cache (LRU order) until a new allocation evicts them; free uncached blocks are
handed out first. Every newly computed full block is announced with a BlockStored event,
every eviction with a BlockRemoved event (DESIGN.md §6), exactly as the mocker does.

With `record_evictions` (a KV block manager behind the pool, tandem.kvbm), each evicted
block is also remembered as an `EvictedBlock` until `take_evicted()`: its KV stays intact in
the cache until the next write into that block, so the owner must export it before any
forward pass or import (`tiering.KvTiering` does).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple

from tandem.engines.native.sequence import Sequence
from tandem.protocols.kv_events import BlockRemoved, BlockStored, KvEvent


class EvictedBlock(NamedTuple):
    """A cached block reused for new data; `block_id` still holds its KV until written."""

    block_id: int
    block_hash: int
    token_ids: list[int]
    parent_hash: int | None
    lora_name: str | None


class BlockManager:
    """Owns the block table of every sequence that holds blocks. Not thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        record_evictions: bool = False,
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[list[int] | None] = [None] * num_blocks
        self.block_parent: list[int | None] = [None] * num_blocks
        self.block_lora: list[str | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.tables: dict[int, list[int]] = {}  # seq_id -> block ids
        self.num_committed: dict[int, int] = {}  # seq_id -> blocks already hashed/announced
        self.events: list[KvEvent] = []
        self.record_evictions = record_evictions
        self.evicted: list[EvictedBlock] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_active_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables.get(seq.seq_id, [])

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    def match_prefix(self, seq: Sequence, *, max_blocks: int | None = None) -> int:
        """On a sequence's first schedule: share every cached full block of its prefix (at
        most (len-1)//block_size blocks: the last token is always computed; at most
        `max_blocks`). Returns the number of tokens served from the cache."""
        assert seq.seq_id not in self.tables, "match_prefix on a sequence that holds blocks"
        table: list[int] = []
        self.tables[seq.seq_id] = table
        if not self.enable_prefix_caching:
            self.num_committed[seq.seq_id] = 0
            return 0
        bs = self.block_size
        limit = (len(seq.token_ids) - 1) // bs
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        for i, h in enumerate(seq.full_block_hashes(bs)[:limit]):
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != seq.token_ids[i * bs : (i + 1) * bs]:
                break
            self.share(block)
            table.append(block)
        self.num_committed[seq.seq_id] = len(table)
        return len(table) * bs

    def cached_run(self, block_hashes: list[int]) -> list[int]:
        """The blocks caching the leading run of the chained `block_hashes` (committed
        blocks only: computed, immutable), without taking a reference."""
        blocks: list[int] = []
        for h in block_hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """Take a reference to a cached block (out of the free LRU if nobody held it)."""
        if self.ref_counts[block] == 0:
            del self.free_cached[block]
        self.ref_counts[block] += 1

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(seq.seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def ensure_slots(self, seq: Sequence, num_tokens: int, *, evict: bool = True) -> bool:
        """Grow the sequence's table to hold `num_tokens` tokens; False (and no change)
        when there are not enough free blocks (`evict=False`: free blocks that hold no
        cached prefix)."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > (self.num_free_blocks if evict else len(self.free_uncached)):
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        self.num_committed.setdefault(seq.seq_id, 0)
        evicted: list[int] = []
        for _ in range(needed):
            table.append(self._take_free_block(evicted))
        if evicted:
            self.events.append(BlockRemoved(block_hashes=evicted))
        return True

    def _take_free_block(self, evicted: list[int]) -> int:
        if self.free_uncached:
            block = self.free_uncached.popleft()
        else:
            block, _ = self.free_cached.popitem(last=False)
            h = self.block_hash[block]
            assert h is not None
            del self.hash_to_block[h]
            evicted.append(h)
            if self.record_evictions:
                tokens = self.block_tokens[block]
                assert tokens is not None
                self.evicted.append(
                    EvictedBlock(block, h, tokens, self.block_parent[block], self.block_lora[block])
                )
            self.block_hash[block] = self.block_tokens[block] = self.block_parent[block] = None
            self.block_lora[block] = None
        self.ref_counts[block] = 1
        return block

    def take_evicted(self) -> list[EvictedBlock]:
        """Evictions recorded since the last call, oldest first."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def onboard_candidates(self, seq: Sequence, num_cached_tokens: int) -> list[int]:
        """Hashes of the prompt's full blocks after the `num_cached_tokens` matched on device
        that a lower tier could supply: up to the last computable block (the last token is
        always computed) and the first one already held here."""
        bs = self.block_size
        hashes = seq.full_block_hashes(bs)[: (len(seq.token_ids) - 1) // bs]
        out: list[int] = []
        for h in hashes[num_cached_tokens // bs :]:
            if h in self.hash_to_block:
                break
            out.append(h)
        return out

    def allocate_onboarded(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Append `num_blocks` fresh blocks to the sequence's table (right after its matched
        prefix) and cache them as its next full blocks, announced with BlockStored. The
        caller writes their KV before the next forward pass. Needs `num_blocks` free blocks."""
        assert num_blocks <= self.num_free_blocks, "onboarding more blocks than are free"
        bs = self.block_size
        table = self.tables[seq.seq_id]
        first = len(table)
        assert self.num_committed[seq.seq_id] == first, "onboarding after uncommitted blocks"
        hashes = seq.full_block_hashes(bs)
        evicted: list[int] = []
        new_blocks = [self._take_free_block(evicted) for _ in range(num_blocks)]
        if evicted:
            self.events.append(BlockRemoved(block_hashes=evicted))
        for i, block in enumerate(new_blocks, start=first):
            assert hashes[i] not in self.hash_to_block, "onboarding a block already cached"
            self.hash_to_block[hashes[i]] = block
            self.block_hash[block] = hashes[i]
            self.block_tokens[block] = seq.token_ids[i * bs : (i + 1) * bs]
            self.block_parent[block] = hashes[i - 1] if i else None
            self.block_lora[block] = seq.lora_name
        table += new_blocks
        self.num_committed[seq.seq_id] = len(table)
        self._announce(seq, list(range(first, len(table))), hashes)
        return new_blocks

    def commit(self, seq: Sequence) -> None:
        """Hash and announce the sequence's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        done = self.num_committed[seq.seq_id]
        num_full = seq.num_computed_tokens // bs
        if num_full <= done:
            return
        hashes = seq.full_block_hashes(bs)
        table = self.tables[seq.seq_id]
        stored: list[int] = []
        for i in range(done, num_full):
            h, block = hashes[i], table[i]
            if h in self.hash_to_block or self.block_hash[block] is not None:
                continue  # an identical block is already cached (computed concurrently)
            self.hash_to_block[h] = block
            self.block_hash[block] = h
            self.block_tokens[block] = seq.token_ids[i * bs : (i + 1) * bs]
            self.block_parent[block] = hashes[i - 1] if i else None
            self.block_lora[block] = seq.lora_name
            stored.append(i)
        self.num_committed[seq.seq_id] = num_full
        self._announce(seq, stored, hashes)

    def _announce(self, seq: Sequence, stored: list[int], hashes: list[int]) -> None:
        bs = self.block_size
        run: list[int] = []
        for i in [*stored, -1]:  # one event per run of consecutive blocks
            if run and i != run[-1] + 1:
                first = run[0]
                self.events.append(
                    BlockStored(
                        block_hashes=[hashes[j] for j in run],
                        parent_hash=hashes[first - 1] if first else None,
                        token_ids=seq.token_ids[first * bs : (run[-1] + 1) * bs],
                        block_size=bs,
                        lora_name=seq.lora_name,
                    )
                )
                run = []
            run.append(i)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of the sequence's table beyond those `num_tokens` tokens
        need (taken for speculative tokens that were rejected). Those blocks were never
        committed: they hold no hash and nobody shares them."""
        table = self.tables.get(seq.seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        assert self.num_committed[seq.seq_id] <= keep, "trimming a committed block"
        for block in reversed(table[keep:]):  # tail first, as `free` does
            assert self.ref_counts[block] == 1 and self.block_hash[block] is None
            self.ref_counts[block] = 0
            self.free_uncached.appendleft(block)
        del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (tail first, so tails are evicted first)."""
        table = self.tables.pop(seq.seq_id, None)
        self.num_committed.pop(seq.seq_id, None)
        for block in reversed(table or ()):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"double free of block {block}"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free_uncached.append(block)
                else:
                    self.free_cached[block] = None

    def snapshot(self) -> list[KvEvent]:
        """BlockStored for every cached block, parents before children, one event per chain
        segment (a run of blocks each the parent of the next), as the mocker reports them."""
        children: dict[int, list[int]] = {}
        roots: list[int] = []
        for h, block in self.hash_to_block.items():
            parent = self.block_parent[block]
            if parent is not None and parent in self.hash_to_block:
                children.setdefault(parent, []).append(h)
            else:
                roots.append(h)
        events: list[KvEvent] = []
        stack = [(h, self.block_parent[self.hash_to_block[h]]) for h in reversed(roots)]
        while stack:
            h, parent = stack.pop()
            run = [h]
            while kids := children.get(run[-1]):
                stack.extend((kid, run[-1]) for kid in reversed(kids[1:]))
                run.append(kids[0])
            blocks = [self.hash_to_block[x] for x in run]
            events.append(
                BlockStored(
                    block_hashes=run,
                    parent_hash=parent,
                    token_ids=[t for b in blocks for t in self.block_tokens[b] or ()],
                    block_size=self.block_size,
                    lora_name=self.block_lora[blocks[0]],
                )
            )
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError when refs, free lists, tables or the hash map disagree."""
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                refs[block] += 1
        assert refs == self.ref_counts, "ref counts differ from the block tables"
        free = list(self.free_uncached) + list(self.free_cached)
        assert len(free) == len(set(free)), "a block is free twice"
        assert all(self.ref_counts[b] == 0 for b in free), "a used block is in a free list"
        num_used = sum(1 for r in self.ref_counts if r > 0)
        assert num_used + len(free) == self.num_blocks, "a block is neither used nor free"
        assert all(self.block_hash[b] is None for b in self.free_uncached)
        assert all(self.block_hash[b] is not None for b in self.free_cached)
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"hash map points at block {block} wrongly"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
