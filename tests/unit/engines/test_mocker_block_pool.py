from __future__ import annotations

import random

import pytest

from tandem.engines.mocker import c_block_pool
from tandem.engines.mocker.block_pool import BlockPool, PyBlockPool
from tandem.engines.mocker.c_block_pool import new_block_pool
from tandem.protocols.kv_events import BlockRemoved, BlockStored
from tandem.tokens.hashing import sequence_hashes

BS = 4


@pytest.fixture(autouse=True, params=["c", "python"])
def _pool_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on both pools: `new_block_pool(...)` builds the C one, else the Python one."""
    if request.param == "python":
        monkeypatch.setattr(c_block_pool, "c_core", lambda: None)


def _chain(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate and cache full blocks for `tokens`; returns (block ids, hashes)."""
    hashes = sequence_hashes(tokens, BS)
    ids = pool.allocate(len(hashes))
    assert ids is not None
    pool.cache_full_blocks(ids, hashes, None, tokens[: len(hashes) * BS])
    return ids, hashes


def test_allocate_until_exhausted_then_release_returns_blocks() -> None:
    pool = new_block_pool(4, BS)
    ids = pool.allocate(3)
    assert ids is not None and len(set(ids)) == 3
    assert pool.allocate(2) is None  # nothing changes on failure
    assert pool.num_active_blocks == 3
    pool.release(ids)
    pool.check_integrity()
    assert pool.num_active_blocks == 0 and pool.num_allocatable_blocks == 4


def test_double_free_is_caught() -> None:
    pool = new_block_pool(2, BS)
    ids = pool.allocate(1)
    assert ids is not None
    pool.release(ids)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(ids)


def test_check_integrity_detects_a_leaked_block() -> None:
    pool = PyBlockPool(3, BS)
    pool.allocate(1)
    pool._free.popleft()  # a free block vanishes from the free list
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity()


def test_stored_event_carries_chain_tokens_and_parent() -> None:
    pool = new_block_pool(8, BS)
    tokens = list(range(10))  # two full blocks + 2 tokens
    _ids, hashes = _chain(pool, tokens)
    assert pool.drain_events() == [
        BlockStored(block_hashes=hashes, parent_hash=None, token_ids=tokens[:8], block_size=BS)
    ]
    # continue the chain with one more block: parent is the last hash
    more = [*tokens[:8], 50, 51, 52, 53]
    new_hash = sequence_hashes(more, BS)[2]
    [bid] = pool.allocate(1) or []
    pool.cache_full_blocks([bid], [new_hash], hashes[-1], more[8:12])
    [event] = pool.drain_events()
    assert isinstance(event, BlockStored)
    assert event.parent_hash == hashes[-1] and event.block_hashes == [new_hash]
    pool.check_integrity()


def test_prefix_match_and_reuse_after_release() -> None:
    pool = new_block_pool(8, BS)
    ids, _hashes = _chain(pool, list(range(12)))
    pool.release(ids)
    assert pool.num_active_blocks == 0 and pool.num_cached_blocks == 3
    other = sequence_hashes([*list(range(8)), 99, 98, 97, 96], BS)
    hit = pool.match_prefix(other)
    assert hit == ids[:2]
    pool.acquire(hit)
    assert pool.num_active_blocks == 2
    pool.check_integrity()


def test_duplicate_block_is_not_cached_twice_and_emits_nothing() -> None:
    pool = new_block_pool(8, BS)
    tokens = list(range(8))
    _first, hashes = _chain(pool, tokens)
    pool.drain_events()
    second = pool.allocate(2)
    assert second is not None
    pool.cache_full_blocks(second, hashes, None, tokens)
    assert pool.drain_events() == []
    pool.release(second)  # duplicates go back to the free list, uncached
    pool.check_integrity()
    assert pool.num_cached_blocks == 2


def test_lru_evicts_oldest_unused_tail_first_with_removed_event() -> None:
    pool = new_block_pool(4, BS)
    a_ids, a_hashes = _chain(pool, list(range(8)))
    b_ids, _b_hashes = _chain(pool, list(range(100, 108)))
    pool.release(a_ids)  # A unused first → oldest
    pool.release(b_ids)
    pool.drain_events()
    got = pool.allocate(1)
    assert got == [a_ids[1]]  # A's tail goes first, its first block stays
    assert pool.drain_events() == [BlockRemoved(block_hashes=[a_hashes[1]])]
    assert pool.match_prefix(a_hashes) == [a_ids[0]]
    pool.check_integrity()


def test_snapshot_describes_every_cached_block_parents_first() -> None:
    pool = new_block_pool(16, BS)
    base = list(range(8))
    _a_ids, a_hashes = _chain(pool, [*base, 1, 2, 3, 4])
    b_hashes = sequence_hashes([*base, 9, 9, 9, 9], BS)
    b_new = pool.allocate(1) or []
    pool.cache_full_blocks(b_new, b_hashes[2:], b_hashes[1], [9, 9, 9, 9])
    seen: set[int] = set()
    for event in pool.snapshot():
        assert isinstance(event, BlockStored)
        assert event.parent_hash is None or event.parent_hash in seen
        assert len(event.token_ids) == len(event.block_hashes) * BS
        seen.update(event.block_hashes)
    assert seen == set(a_hashes) | set(b_hashes)


def test_random_operations_keep_integrity() -> None:
    rng = random.Random(7)
    pool = new_block_pool(32, BS)
    held: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            tokens = [rng.randrange(4) for _ in range(BS * rng.randrange(1, 5))]
            hashes = sequence_hashes(tokens, BS)
            hit = pool.match_prefix(hashes)
            pool.acquire(hit)
            fresh = pool.allocate(len(hashes) - len(hit))
            if fresh is None:
                pool.release(hit)
            else:
                parent = hashes[len(hit) - 1] if hit else None
                pool.cache_full_blocks(fresh, hashes[len(hit) :], parent, tokens[len(hit) * BS :])
                held.append(hit + fresh)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))))
        pool.check_integrity()
    for ids in held:
        pool.release(ids)
    pool.check_integrity()
    assert pool.num_active_blocks == 0


def test_memory_stays_flat_as_the_prefix_cache_fills_and_turns_over() -> None:
    """A soak grew each mocker worker by ~2.4 MB/min: every cached block kept its tokens as
    a tuple of Python ints (~2.3 KB at block size 64). The token storage is allocated with
    the pool, so filling the cache (and evicting, 3 times over) adds only the bookkeeping of
    the cached hashes."""
    import tracemalloc

    num_blocks, block_size = 512, 64
    pool = new_block_pool(num_blocks, block_size)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3 * num_blocks):
            tokens = [rng.randrange(1000, 50_000) for _ in range(block_size)]
            ids = pool.allocate(1)
            assert ids is not None
            pool.cache_full_blocks(ids, sequence_hashes(tokens, block_size), None, tokens)
            pool.release(ids)
            pool.drain_events()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    pool.check_integrity()
    assert pool.num_cached_blocks == num_blocks
    assert grown / num_blocks < 600, f"{grown / num_blocks:.0f} bytes per cached block"
    assert pool.block_tokens(ids[0]) == tokens  # the last block's tokens are kept exactly
