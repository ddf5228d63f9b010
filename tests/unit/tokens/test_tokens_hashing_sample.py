"""`hashes_match_sample`: a receiver's O(3 blocks) check of block hashes shipped with a
request, against the one definition in tandem.tokens.hashing."""

from __future__ import annotations

import random
from array import array

import pytest

from tandem.protocols.engine import MmItem
from tandem.tokens.hashing import hashes_match_sample, sequence_hashes

pytestmark = pytest.mark.timeout(10)
rng = random.Random(7)
TOKENS = [rng.randrange(50_000) for _ in range(16 * 40 + 5)]


def test_the_definition_passes_as_list_and_as_u32_array() -> None:
    hashes = sequence_hashes(TOKENS, 16, lora_name="a", cache_salt="s")
    assert sequence_hashes(array("I", TOKENS), 16, lora_name="a", cache_salt="s") == hashes
    for ids in (TOKENS, array("I", TOKENS)):
        assert hashes_match_sample(ids, hashes, 16, lora_name="a", cache_salt="s")
        assert hashes_match_sample(ids, hashes[:7], 16, lora_name="a", cache_salt="s")


@pytest.mark.parametrize("index", [0, 20, 39])
def test_a_wrong_sampled_block_fails(index: int) -> None:
    hashes = sequence_hashes(TOKENS, 16)
    hashes[index] ^= 1
    assert not hashes_match_sample(TOKENS, hashes, 16)


def test_other_seed_block_size_tokens_or_length_fail() -> None:
    hashes = sequence_hashes(TOKENS, 16)
    assert not hashes_match_sample(TOKENS, hashes, 16, lora_name="other")
    assert not hashes_match_sample(TOKENS, sequence_hashes(TOKENS, 32), 32 // 2)
    assert not hashes_match_sample([t + 1 for t in TOKENS], hashes, 16)
    assert not hashes_match_sample(TOKENS[:100], hashes, 16)  # more hashes than blocks
    assert hashes_match_sample(TOKENS, [], 16)


def test_images_are_part_of_the_checked_blocks() -> None:
    items = [MmItem(mm_hash=11, offset=300, num_tokens=40)]
    hashes = sequence_hashes(TOKENS, 16, mm_items=items)
    assert hashes_match_sample(TOKENS, hashes, 16, mm_items=items)
    other = [MmItem(mm_hash=12, offset=300, num_tokens=40)]
    assert not hashes_match_sample(TOKENS, hashes, 16, mm_items=other)
