"""The one-pass block hashing equals the per-block definition of DESIGN.md §5, so routing,
engines and kvbm keep the same block hashes."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from tandem.protocols.engine import MmItem
from tandem.tokens.hashing import HASH_SEED, local_hashes, seed_for, sequence_hashes


def _reference(ids, block_size, seed0, parent, extras):  # type: ignore[no-untyped-def]
    """Per block: slice, pack LE u32, hash; then chain with LE u64 pairs."""
    out, prev = [], parent
    for i in range(len(ids) // block_size):
        data = struct.pack(f"<{block_size}I", *ids[i * block_size : (i + 1) * block_size])
        data += extras.get(i, b"")
        local = xxhash.xxh3_64_intdigest(data, seed=seed0 if i == 0 else HASH_SEED)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(
            struct.pack("<QQ", prev, local), seed=HASH_SEED
        )  # fmt: skip
        out.append(prev)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_sequence_hashes_equal_the_per_block_definition(block_size: int) -> None:
    rng = random.Random(block_size)
    for trial in range(30):
        ids = [rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 700))]
        lora = rng.choice([None, "adapter-a"])
        salt = rng.choice([None, "s1"])
        parent = rng.choice([None, rng.randrange(0, 2**64)])
        got = sequence_hashes(ids, block_size, lora_name=lora, cache_salt=salt, parent_hash=parent)
        seed0 = HASH_SEED if parent is not None else seed_for(lora, salt)
        assert got == _reference(ids, block_size, seed0, parent, {}), trial


def test_local_hashes_are_the_unchained_blocks() -> None:
    ids = list(range(1000, 1100))
    locals_ = local_hashes(ids, 16, lora_name="x")
    assert len(locals_) == 6
    assert locals_[0] == xxhash.xxh3_64_intdigest(
        struct.pack("<16I", *ids[:16]), seed=seed_for("x", None)
    )
    assert locals_[1] == xxhash.xxh3_64_intdigest(struct.pack("<16I", *ids[16:32]), seed=HASH_SEED)


def test_mm_blocks_append_the_sorted_image_hashes() -> None:
    ids = list(range(64))
    items = [
        MmItem(mm_hash=9, offset=10, num_tokens=20),
        MmItem(mm_hash=3, offset=30, num_tokens=5),
    ]
    extras = {
        0: struct.pack("<Q", 9),
        1: struct.pack("<2Q", 3, 9),
        2: struct.pack("<Q", 3),
    }
    assert sequence_hashes(ids, 16, mm_items=items) == _reference(ids, 16, HASH_SEED, None, extras)


def test_misaligned_continuation_with_images_is_refused_even_without_full_blocks() -> None:
    with pytest.raises(ValueError, match="token_offset"):
        sequence_hashes([1, 2], 16, mm_items=[MmItem(mm_hash=1, offset=0, num_tokens=1)],
                        token_offset=3, parent_hash=5)  # fmt: skip


def test_long_prompts_take_the_c_pass_and_hash_as_the_python_pass(monkeypatch) -> None:
    from array import array

    from tandem.tokens import hashing

    assert hashing._c_hasher() is not None, "gcc and xxhash are here: the C pass must load"
    calls = []
    real = hashing._c_hashes
    monkeypatch.setattr(hashing, "_c_hashes", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(5)
    for trial in range(20):
        n = rng.choice([4 * 64, 4 * 64 + 7, 32000, rng.randrange(256, 3000)])
        ids = [rng.randrange(0, 2**32) for _ in range(n)]
        size = rng.choice([16, 64])
        parent = rng.choice([None, rng.randrange(0, 2**64)])
        lora = rng.choice([None, "adapter-a"])
        seed0 = HASH_SEED if parent is not None else seed_for(lora, None)
        want = _reference(ids, size, seed0, parent, {})
        assert sequence_hashes(ids, size, lora_name=lora, parent_hash=parent) == want, trial
        assert sequence_hashes(array("I", ids), size, lora_name=lora, parent_hash=parent) == want
        assert local_hashes(ids, size) == hashing._loop_hashes(
            ids, n // size, size, HASH_SEED, None, (), 0, False
        )
    assert len(calls) == 60  # every call above went through C
    monkeypatch.setattr(hashing, "_c_state", [None])  # no compiler: the Python pass
    ids = list(range(5000))
    assert sequence_hashes(ids, 64) == _reference(ids, 64, HASH_SEED, None, {})
    assert len(calls) == 60
