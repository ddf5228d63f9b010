"""Block manager: prefix sharing, LRU eviction and the KV events the router consumes."""

from __future__ import annotations

import pytest
from native_tiny import request

from tandem.engines.native.block_manager import BlockManager
from tandem.engines.native.sequence import Sequence
from tandem.protocols.kv_events import BlockRemoved, BlockStored
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(10)
BS = 4


def seq(rid: str, tokens: list[int], **kw) -> Sequence:
    return Sequence(request(rid, tokens, **kw), (2,))


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What a step does: hold the tokens, mark them computed, commit full blocks."""
    cached = bm.match_prefix(s)
    assert bm.ensure_slots(s, len(s.token_ids))
    s.num_computed_tokens = len(s.token_ids)
    bm.commit(s)
    bm.check_integrity()
    return cached


def test_full_blocks_are_announced_with_chained_hashes():
    bm = BlockManager(8, BS)
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    s = seq("a", tokens)
    assert compute_all(bm, s) == 0
    (event,) = bm.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == sequence_hashes(tokens, BS)
    assert event.parent_hash is None and event.token_ids == tokens[:8] and event.block_size == BS
    s.token_ids += [20, 21]  # two decoded tokens fill block 3
    assert bm.ensure_slots(s, 12)
    s.num_computed_tokens = 12
    bm.commit(s)
    (event,) = bm.take_events()
    assert event.parent_hash == sequence_hashes(tokens, BS)[-1]
    assert event.block_hashes == sequence_hashes([*tokens, 20, 21], BS)[2:]


def test_prefix_is_shared_and_the_last_token_always_computed():
    bm = BlockManager(8, BS)
    a = seq("a", list(range(8)))
    compute_all(bm, a)
    b = seq("b", list(range(8)))  # identical prompt: only block 0 may come from the cache
    assert bm.match_prefix(b) == 4
    assert bm.block_table(b)[0] == bm.block_table(a)[0]
    assert bm.ref_counts[bm.block_table(a)[0]] == 2
    assert bm.ensure_slots(b, 8)
    b.num_computed_tokens = 8
    bm.commit(b)  # block 1 duplicates a's block 1: stays uncached, no event
    assert bm.take_events() == [
        BlockStored(
            block_hashes=sequence_hashes(range(8), BS), token_ids=list(range(8)), block_size=BS
        )
    ]
    bm.free(b)
    bm.free(a)
    bm.check_integrity()
    assert bm.num_active_blocks == 0 and len(bm.hash_to_block) == 2


def test_salted_requests_do_not_share():
    bm = BlockManager(8, BS)
    compute_all(bm, seq("a", list(range(9))))
    salted = Sequence(request("b", list(range(9))), (2,))
    salted.cache_salt = "tenant-2"
    assert bm.match_prefix(salted) == 0


def test_eviction_is_lru_and_announced():
    bm = BlockManager(4, BS)
    old, new = seq("old", [1] * 5), seq("new", [2] * 5)
    compute_all(bm, old)
    compute_all(bm, new)
    bm.free(old)
    bm.free(new)
    bm.take_events()
    hungry = seq("h", [3] * 13)  # needs 4 blocks: 2 uncached free, then evicts old, then new
    assert bm.match_prefix(hungry) == 0
    assert bm.ensure_slots(hungry, 9)
    assert bm.take_events() == [BlockRemoved(block_hashes=sequence_hashes([1] * 4, BS))]
    assert bm.ensure_slots(hungry, 13)
    assert bm.take_events() == [BlockRemoved(block_hashes=sequence_hashes([2] * 4, BS))]
    assert not bm.ensure_slots(hungry, 17)  # nothing left: refused without change
    assert len(bm.block_table(hungry)) == 4
    bm.check_integrity()


def test_snapshot_lists_every_cached_chain_segment_parents_first():
    bm = BlockManager(16, BS)
    a = seq("a", list(range(13)))  # 3 full blocks
    compute_all(bm, a)
    b = seq("b", [*range(8), 50, 51, 52, 53, 54])  # shares 2 blocks, then branches
    compute_all(bm, b)
    bm.free(a)
    bm.free(b)
    snap = bm.snapshot()
    ha, hb = sequence_hashes(range(13), BS), sequence_hashes(b.token_ids, BS)
    assert (
        [(e.parent_hash, e.block_hashes) for e in snap]
        == [
            (None, ha),  # root chain follows the first child
            (ha[1], hb[2:]),  # the branch, after its parent
        ]
    )
    assert snap[0].token_ids == list(range(12)) and snap[1].token_ids == [50, 51, 52, 53]


def test_integrity_check_catches_a_leak():
    bm = BlockManager(4, BS)
    s = seq("a", [1, 2, 3])
    bm.match_prefix(s)
    bm.ensure_slots(s, 3)
    bm.tables.pop(s.seq_id)  # forget the table without freeing its block
    with pytest.raises(AssertionError):
        bm.check_integrity()
