"""Multimodal block hashing (DESIGN.md §5): image hashes mixed into the blocks they overlap."""

from __future__ import annotations

import struct

import pytest
import xxhash

from tandem.protocols.engine import MmItem
from tandem.tokens.hashing import HASH_SEED, local_hashes, sequence_hashes

BS = 4
PH = 16  # a placeholder token id


def _prompt(num_text_before: int, num_image: int, num_text_after: int) -> list[int]:
    return (
        [100 + i for i in range(num_text_before)]
        + [PH] * num_image
        + [200 + i for i in range(num_text_after)]
    )


def test_block_overlapping_an_image_appends_its_hash_le_u64() -> None:
    ids = _prompt(2, 6, 4)  # image rows 2..7 → blocks 0 and 1
    item = MmItem(mm_hash=0xDEADBEEF_01234567, offset=2, num_tokens=6)
    got = local_hashes(ids, BS, mm_items=[item])
    tokens = struct.pack("<4I", *ids[:4])
    assert got[0] == xxhash.xxh3_64_intdigest(
        tokens + struct.pack("<Q", item.mm_hash), seed=HASH_SEED
    )
    assert got[2] == local_hashes(ids, BS)[2]  # block 2 is text only: unchanged


def test_same_image_same_blocks_different_image_no_shared_block_after_it() -> None:
    ids = _prompt(5, 8, 7)  # block 0 text only; image rows 5..12 (blocks 1..3)
    a = sequence_hashes(ids, BS, mm_items=[MmItem(mm_hash=1, offset=5, num_tokens=8)])
    a2 = sequence_hashes(ids, BS, mm_items=[MmItem(mm_hash=1, offset=5, num_tokens=8)])
    b = sequence_hashes(ids, BS, mm_items=[MmItem(mm_hash=2, offset=5, num_tokens=8)])
    assert a == a2
    assert a[0] == b[0]  # the text before the image is shared
    assert not set(a[1:]) & set(b)  # from the first image block on, nothing is shared


def test_several_images_in_one_block_are_sorted() -> None:
    ids = [PH] * 4
    one = [MmItem(mm_hash=9, offset=0, num_tokens=2), MmItem(mm_hash=3, offset=2, num_tokens=2)]
    other = [MmItem(mm_hash=3, offset=0, num_tokens=2), MmItem(mm_hash=9, offset=2, num_tokens=2)]
    expected = xxhash.xxh3_64_intdigest(
        struct.pack("<4I", *ids) + struct.pack("<2Q", 3, 9), seed=HASH_SEED
    )
    assert (
        local_hashes(ids, BS, mm_items=one) == local_hashes(ids, BS, mm_items=other) == [expected]
    )


@pytest.mark.parametrize("split_block", [1, 2, 3])
def test_continuation_with_token_offset_matches_whole_prompt(split_block: int) -> None:
    ids = _prompt(3, 9, 8)
    items = [MmItem(mm_hash=77, offset=3, num_tokens=9)]
    whole = sequence_hashes(ids, BS, mm_items=items, cache_salt="s")
    cut = split_block * BS
    head = sequence_hashes(ids[:cut], BS, mm_items=items, cache_salt="s")
    tail = sequence_hashes(ids[cut:], BS, mm_items=items, parent_hash=head[-1], token_offset=cut)
    assert head + tail == whole


def test_token_offset_must_be_block_aligned() -> None:
    with pytest.raises(ValueError, match="token_offset=3"):
        local_hashes(
            [PH] * 8, BS, mm_items=[MmItem(mm_hash=1, offset=0, num_tokens=8)], token_offset=3
        )
