"""Block hashing shared by router, engines and kvbm (DESIGN.md §5).

local hash = XXH3-64(seed 1337) over a full block's token ids as little-endian u32;
sequence hash: seq[0] = local[0] (block 0's seed changed by LoRA name / cache_salt),
seq[i] = XXH3-64(seed 1337, LE u64 bytes of [seq[i-1], local[i]]).

Multimodal: a block that overlaps the embedding rows of images appends the sorted mm_hashes of
those images (LE u64) to its token bytes before hashing, so the same placeholder tokens next to a
different image never share a block.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import xxhash

log = logging.getLogger(__name__)

HASH_SEED = 1337
_U64_MASK = (1 << 64) - 1
_pair = struct.Struct("<QQ")
_is_le = array("I").itemsize == 4 and struct.pack("=I", 1) == struct.pack("<I", 1)


class MmSpan(Protocol):
    """An image's rows in a prompt: `token_ids[offset : offset + num_tokens]` (MmItem has these)."""

    @property
    def mm_hash(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


def _u32_bytes(token_ids: Sequence[int]) -> bytes | memoryview:
    if _is_le and isinstance(token_ids, array) and token_ids.typecode == "I":
        return memoryview(token_ids).cast("B")  # already LE u32: no copy
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
    mm_items: Sequence[MmSpan] = (),
    token_offset: int = 0,
) -> list[int]:
    """Local hashes of every full block; block 0 uses the LoRA/salt seed.

    `mm_items` place images by absolute prompt position; `token_ids[0]` sits at absolute position
    `token_offset` (a continuation of a longer prompt)."""
    return _hashes(token_ids, block_size, seed_for(lora_name, cache_salt), None, mm_items,
                   token_offset, chain=False)  # fmt: skip


def _hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed0: int,
    parent_hash: int | None,
    mm_items: Sequence[MmSpan],
    token_offset: int,
    *,
    chain: bool,
) -> list[int]:
    """Every full block's hash: in one C call (`_c_hashes`) for text prompts of at least
    C_MIN_BLOCKS blocks where it is available, else the Python pass (`_loop_hashes`)."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be > 0")
    num_full = len(token_ids) // block_size
    if num_full >= C_MIN_BLOCKS and not mm_items and (c := _c_hasher()) is not None:
        return _c_hashes(c, token_ids, num_full, block_size, seed0, parent_hash, chain)
    return _loop_hashes(
        token_ids, num_full, block_size, seed0, parent_hash, mm_items, token_offset, chain
    )


def _loop_hashes(
    token_ids: Sequence[int],
    num_full: int,
    block_size: int,
    seed0: int,
    parent_hash: int | None,
    mm_items: Sequence[MmSpan],
    token_offset: int,
    chain: bool,
) -> list[int]:
    """One pass over the prompt's LE u32 bytes: each block hashed from a zero-copy view and, with
    `chain`, folded into the sequence hash at once (no intermediate list of local hashes)."""
    extras = _mm_extras(mm_items, num_full, block_size, token_offset) if mm_items else None
    data = memoryview(_u32_bytes(token_ids[: num_full * block_size]))
    width = block_size * 4
    digest, pack = xxhash.xxh3_64_intdigest, _pair.pack
    out: list[int] = []
    append = out.append
    prev = None if parent_hash is None else parent_hash & _U64_MASK
    seed = seed0
    for start in range(0, num_full * width, width):
        block = data[start : start + width]
        if extras is not None and (extra := extras.get(start // width)) is not None:
            block = memoryview(bytes(block) + extra)
        local = digest(block, seed=seed)
        seed = HASH_SEED
        if chain:
            prev = local if prev is None else digest(pack(prev, local), seed=HASH_SEED)
            append(prev)
        else:
            append(local)
    return out


# ------------------------------------------------------------------ the C pass
# Prompts of at least this many full blocks are hashed by `chain_hash.c` in one call (the
# same XXH3 function, the same bytes; measured at 32000 tokens, 500 blocks of 64: ~1 us a
# block in the Python loop above, ~0.05 us in C). Fewer: the loop is as quick as the call.
C_MIN_BLOCKS = 4
_C_SOURCE = Path(__file__).with_name("chain_hash.c")
_c_lock = threading.Lock()
_c_state: list[tuple[ctypes.CDLL, int] | None] = []  # [] until tried; [None] if unavailable


def _c_hasher() -> tuple[ctypes.CDLL, int] | None:
    """(library, XXH3 function address), built and checked once per process; None (one log
    line) without a compiler, on a big-endian host, or if the `xxhash` build does not export
    XXH3_64bits_withSeed or the C pass disagrees with the Python one on a sample."""
    if _c_state:
        return _c_state[0]
    with _c_lock:
        if not _c_state:
            _c_state.append(_load_c_hasher())
    return _c_state[0]


def _load_c_hasher() -> tuple[ctypes.CDLL, int] | None:
    from tandem.cbuild import CBuildError, compile_c

    if not _is_le:
        return None
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]

        lib = ctypes.CDLL(str(compile_c(_C_SOURCE, "chain_hash", ("-O2", "-fPIC", "-shared"))))
        xxh3 = ctypes.cast(ctypes.CDLL(_xxhash.__file__).XXH3_64bits_withSeed, ctypes.c_void_p)
    except (CBuildError, OSError, AttributeError, ImportError) as exc:
        log.warning("block hashes take the Python pass: %s", exc)
        return None
    i64, p, u64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64
    lib.th_block_hashes.argtypes = [p, p, i64, i64, u64, u64, ctypes.c_int, ctypes.c_int, u64, p]
    lib.th_block_hashes.restype = i64
    c = (lib, xxh3.value or 0)
    ids = list(range(3 * C_MIN_BLOCKS * 16, 0, -3))
    for args in ((HASH_SEED + 1, None, True), (HASH_SEED, 7, True), (HASH_SEED, None, False)):
        n = len(ids) // 16
        seed0, parent, chain = args
        if _c_hashes(c, ids, n, 16, *args) != _loop_hashes(ids, n, 16, seed0, parent, (), 0, chain):
            log.warning("block hashes take the Python pass: the C pass disagrees on a sample")
            return None
    return c


def _c_hashes(
    c: tuple[ctypes.CDLL, int],
    token_ids: Sequence[int],
    num_full: int,
    block_size: int,
    seed0: int,
    parent_hash: int | None,
    chain: bool,
) -> list[int]:
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else None
    if ids is None:
        ids = array("I", token_ids[: num_full * block_size])
    out = array("Q", bytes(8 * num_full))
    c[0].th_block_hashes(
        c[1], ids.buffer_info()[0], num_full, block_size, seed0, HASH_SEED, chain,
        parent_hash is not None, (parent_hash or 0) & _U64_MASK, out.buffer_info()[0],
    )  # fmt: skip
    return out.tolist()


def _mm_extras(
    mm_items: Sequence[MmSpan], num_full: int, block_size: int, token_offset: int
) -> dict[int, bytes]:
    """Per block index (relative to token_offset): the sorted LE u64 mm_hashes of the images
    whose rows it overlaps (one entry per image, so an image repeated in a block counts twice)."""
    if token_offset % block_size:
        raise ValueError(f"token_offset={token_offset} must be a multiple of block_size")
    limit = num_full * block_size
    overlapping: dict[int, list[int]] = {}
    for item in mm_items:
        start = max(item.offset - token_offset, 0)
        end = min(item.offset - token_offset + item.num_tokens, limit)
        for i in range(start // block_size, -(-end // block_size)) if start < end else ():
            overlapping.setdefault(i, []).append(item.mm_hash & _U64_MASK)
    return {i: struct.pack(f"<{len(h)}Q", *sorted(h)) for i, h in overlapping.items()}


def sequence_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    parent_hash: int | None = None,
    mm_items: Sequence[MmSpan] = (),
    token_offset: int = 0,
) -> list[int]:
    """Chained hashes of every full block of `token_ids`.

    With `parent_hash`, `token_ids` continue an existing chain (block 0 of these tokens
    is chained to the parent instead of starting a new sequence); `token_offset` is then the
    absolute position of `token_ids[0]`, so `mm_items` (absolute offsets) land on the right blocks.
    """
    if parent_hash is not None:  # a continuation: only a chain's first block carries the seed
        lora_name = cache_salt = None
    seed0 = seed_for(lora_name, cache_salt)
    return _hashes(token_ids, block_size, seed0, parent_hash, mm_items, token_offset, chain=True)


def hashes_match_sample(
    token_ids: Sequence[int],
    block_hashes: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MmSpan] = (),
) -> bool:
    """Whether `block_hashes`, said to be `sequence_hashes(token_ids, block_size, ...)` of the
    first len(block_hashes) full blocks, check out on a sample: block 0 (the seed: LoRA, salt),
    the last block and the middle one, each recomputed from its tokens and its shipped parent.
    O(3 blocks), not O(prompt); catches another block size, seed, hashing scheme or token list,
    but not a forged chain that is right exactly at the sampled blocks."""
    num = len(block_hashes)
    if num == 0:
        return True
    if num * block_size > len(token_ids):
        return False
    for i in sorted({0, num // 2, num - 1}):
        block = token_ids[i * block_size : (i + 1) * block_size]
        if i == 0:
            got = sequence_hashes(block, block_size, lora_name=lora_name, cache_salt=cache_salt,
                                  mm_items=mm_items)  # fmt: skip
        else:
            got = sequence_hashes(block, block_size, parent_hash=block_hashes[i - 1],
                                  mm_items=mm_items, token_offset=i * block_size)  # fmt: skip
        if got != [block_hashes[i]]:
            return False
    return True
