"""Block hashing shared by router, engines and kvbm (DESIGN.md §5).

local hash = XXH3-64(seed 1337) over a full block's token ids as little-endian u32;
sequence hash: seq[0] = local[0] (block 0's seed changed by LoRA name / cache_salt),
seq[i] = XXH3-64(seed 1337, LE u64 bytes of [seq[i-1], local[i]]).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import xxhash

HASH_SEED = 1337
_U64_MASK = (1 << 64) - 1
_pair = struct.Struct("<QQ")
_is_le = array("I").itemsize == 4 and struct.pack("=I", 1) == struct.pack("<I", 1)


def _u32_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("I", token_ids)
    if not _is_le:
        arr.byteswap()
    return arr.tobytes()


def seed_for(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of block 0: 1337 unless a LoRA adapter or cache salt is set."""
    if not lora_name and not cache_salt:
        return HASH_SEED
    extra = f"{lora_name or ''}\x00{cache_salt or ''}".encode()
    return xxhash.xxh3_64_intdigest(extra, seed=HASH_SEED)


def local_hash(block_token_ids: Sequence[int], seed: int = HASH_SEED) -> int:
    return xxhash.xxh3_64_intdigest(_u32_bytes(block_token_ids), seed=seed)


def chain_hash(parent_hash: int, local: int) -> int:
    return xxhash.xxh3_64_intdigest(_pair.pack(parent_hash & _U64_MASK, local), seed=HASH_SEED)


def local_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Local hashes of every full block; block 0 uses the LoRA/salt seed."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be > 0")
    num_full = len(token_ids) // block_size
    data = _u32_bytes(token_ids[: num_full * block_size])
    width = block_size * 4
    seed0 = seed_for(lora_name, cache_salt)
    out = []
    for i in range(num_full):
        out.append(
            xxhash.xxh3_64_intdigest(
                data[i * width : (i + 1) * width], seed=seed0 if i == 0 else HASH_SEED
            )
        )
    return out


def sequence_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    parent_hash: int | None = None,
) -> list[int]:
    """Chained hashes of every full block of `token_ids`.

    With `parent_hash`, `token_ids` continue an existing chain (block 0 of these tokens
    is chained to the parent instead of starting a new sequence).
    """
    if parent_hash is not None:  # a continuation: only a chain's first block carries the seed
        lora_name = cache_salt = None
    locals_ = local_hashes(token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt)
    out: list[int] = []
    prev = parent_hash
    for h in locals_:
        prev = h if prev is None else chain_hash(prev, h)
        out.append(prev)
    return out
