"""The mocker's block pool with its state in C (`block_pool.c`): reference counts, the free
FIFO, the LRU of cached unreferenced blocks, the hash index, each block's parent hash and LoRA.

Per block the Python pool costs ~0.5 us in allocate, cache and release; a 32000-token request
(500 blocks of 64) spends a third of the mocker's CPU there. Here each operation is one C call
over whole arrays, and Python only builds the KV events from what C returns. The semantics are
`PyBlockPool`'s exactly (the same blocks in the same order, the same events): the library is
checked against it on a sample at load and stands aside (one log line) when it disagrees, or
without a compiler.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from array import array
from collections.abc import Sequence
from pathlib import Path

from tandem.engines.mocker.block_pool import BlockPool, EvictedBlock, PyBlockPool
from tandem.protocols.kv_events import BlockRemoved, KvEvent

log = logging.getLogger(__name__)

_C_SOURCE = Path(__file__).with_name("block_pool.c")
_c_lock = threading.Lock()
_c_state: list[ctypes.CDLL | None] = []  # [] until tried; [None] if unavailable
_FREE, _LRU, _CACHED, _ACTIVE = range(4)  # the struct's leading counters
_CHECKS = {
    1: "a block is on the free list twice",
    2: "blocks both free and evictable: [{}]",
    3: "block {} has a negative ref_count",
    4: "block {} is in use and listed as unused",
    5: "block {} leaked: unreferenced, not free",
    6: "cached block {} leaked: not in the LRU",
    7: "block {} hash missing from the index",
    8: "num_active does not match the count ({})",
    9: "hash index names blocks that are not cached",
    10: "the LRU list's links are broken (at block {})",
}


def c_core() -> ctypes.CDLL | None:
    """The C pool's library, built and checked once per process; None (one log line)
    without a compiler or if it disagrees with `PyBlockPool` on a sample."""
    if _c_state:
        return _c_state[0]
    with _c_lock:
        if not _c_state:
            _c_state.append(_load())
    return _c_state[0]


def new_block_pool(num_blocks: int, block_size: int, *, keep_token_ids: bool = True) -> BlockPool:
    """The pool the mocker runs: a `CBlockPool` where the C core loads (built, and agreeing
    with `PyBlockPool` on a sample), else a `PyBlockPool`."""
    pool_cls: type[BlockPool] = CBlockPool if c_core() is not None else PyBlockPool
    return pool_cls(num_blocks, block_size, keep_token_ids=keep_token_ids)


def _load(*, check: bool = True) -> ctypes.CDLL | None:
    from tandem.cbuild import CBuildError, compile_c

    try:
        lib = ctypes.CDLL(str(compile_c(_C_SOURCE, "block_pool", ("-O2", "-fPIC", "-shared"))))
    except (CBuildError, OSError) as exc:
        log.warning("the mocker's block pool runs in Python: %s", exc)
        return None
    p, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    lib.th_pool_new.argtypes, lib.th_pool_new.restype = [i64], p
    lib.th_pool_free.argtypes, lib.th_pool_free.restype = [p], None
    lib.th_pool_ref_count.argtypes, lib.th_pool_ref_count.restype = [p, i64], i64
    for name, args in (
        ("th_pool_match", [p, p, i64, p]),
        ("th_pool_acquire", [p, p, i64]),
        ("th_pool_allocate", [p, i64, p, p, p, p, p]),
        ("th_pool_cache", [p, p, p, i64, ctypes.c_int, u64, ctypes.c_int32, p, p]),
        ("th_pool_release", [p, p, i64]),
        ("th_pool_cached", [p, p, p, p, p, p, p]),
        ("th_pool_check", [p, p]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i64
    if check and not _agrees_on_a_sample(lib):
        log.warning("the mocker's block pool runs in Python: the C pool disagrees on a sample")
        return None
    return lib


def _agrees_on_a_sample(lib: ctypes.CDLL) -> bool:
    """A short fixed run (allocation with eviction, a duplicate hash, release, re-use) on both
    pools: the same blocks, events and snapshot."""
    c, py = CBlockPool(6, 2, lib=lib), PyBlockPool(6, 2)
    out: list[list[object]] = [[], []]
    for pool, got in zip((c, py), out, strict=True):
        pool.record_evictions = True
        a = pool.allocate(4) or []
        pool.cache_full_blocks(a, [11, 12, 11, 14], 7, list(range(8)), "x")
        pool.release(a)
        b = pool.allocate(5) or []
        pool.cache_full_blocks(b[:1], [21], None, [5, 6])
        got += [a, b, pool.match_prefix([11, 12]), pool.take_evicted(), pool.drain_events()]
        got += [pool.snapshot(), pool.num_allocatable_blocks, pool.num_cached_blocks]
    return out[0] == out[1]


def _addr(buf: array[int]) -> int:
    return buf.buffer_info()[0]


class CBlockPool(BlockPool):
    """`BlockPool` over the C core (see the module docstring). Not thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        keep_token_ids: bool = True,
        lib: ctypes.CDLL | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, keep_token_ids=keep_token_ids)
        lib = lib or c_core()
        if lib is None:
            raise RuntimeError("the C block pool is not available (see the log)")
        self._lib = lib
        self._p = lib.th_pool_new(num_blocks)
        if not self._p:
            raise MemoryError(f"no memory for a C block pool of {num_blocks} blocks")
        weakref.finalize(self, lib.th_pool_free, self._p)
        self._counts = (ctypes.c_int64 * 4).from_address(self._p)
        # scratch outputs, one slot per block (an operation never returns more blocks)
        self._ids = array("q", bytes(8 * num_blocks))
        self._hashes = array("Q", bytes(8 * num_blocks))
        self._parents = array("Q", bytes(8 * num_blocks))
        self._flags = array("B", bytes(num_blocks))
        self._loras = array("i", bytes(4 * num_blocks))
        self._num_dups = array("q", [0])
        self._scratch = tuple(  # their addresses, as allocate passes them (they never move)
            _addr(a) for a in (self._ids, self._hashes, self._parents, self._flags, self._loras)
        )
        self._lora_names: list[str] = []
        self._lora_index: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_active_blocks(self) -> int:
        return self._counts[_ACTIVE]

    @property
    def num_allocatable_blocks(self) -> int:
        return self._counts[_FREE] + self._counts[_LRU]

    @property
    def num_cached_blocks(self) -> int:
        return self._counts[_CACHED]

    @property
    def usage(self) -> float:
        return self._counts[_ACTIVE] / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return int(self._lib.th_pool_ref_count(self._p, self._block_id(block_id)))

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        # in growing slices: a miss (most long prompts) converts a few hashes, not all
        out: list[int] = []
        start, step, num = 0, 8, len(block_hashes)
        while start < num:
            hashes = _u64s(block_hashes[start : start + step])
            ids = self._ids if len(hashes) <= self.num_blocks else array("q", bytes(8 * step))
            found = self._lib.th_pool_match(self._p, _addr(hashes), len(hashes), _addr(ids))
            out += ids[:found].tolist()
            if found < len(hashes):
                break
            start, step = start + step, step * 4
        return out

    # ------------------------------------------------------------------ mutations
    def acquire(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        bad = self._lib.th_pool_acquire(self._p, _addr(ids := array("q", block_ids)), len(ids))
        self._check_range(bad, block_ids)
        assert bad < 0, "acquiring a free block"

    def allocate(self, num: int) -> list[int] | None:
        num_evicted = self._lib.th_pool_allocate(self._p, num, *self._scratch)
        if num_evicted < 0:
            return None
        if num <= 0:
            return []
        out: list[int] = self._ids[:num].tolist()
        if num_evicted:
            removed: list[int] = self._hashes[:num_evicted].tolist()
            if self.record_evictions:
                self._record(removed, out[num - num_evicted :])
            self._events.append(BlockRemoved(block_hashes=removed))
        return out

    def _record(self, removed: list[int], block_ids: list[int]) -> None:
        names, parents, flags, loras = self._lora_names, self._parents, self._flags, self._loras
        self._evicted += [
            EvictedBlock(
                h,
                parents[k] if flags[k] else None,
                tuple(self.block_tokens(block_id)),
                names[loras[k]] if loras[k] >= 0 else None,
            )
            for k, (h, block_id) in enumerate(zip(removed, block_ids, strict=True))
        ]

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> None:
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids for {len(block_hashes)} hashes")
        num = len(block_ids)
        ids, hashes = array("q", block_ids), _u64s(block_hashes)
        # repeats of a block whose hash was a duplicate may outnumber the pool
        dups = self._flags if num <= self.num_blocks else array("B", bytes(num))
        lora = -1 if lora_name is None else self._lora(lora_name)
        bad = self._lib.th_pool_cache(
            self._p, _addr(ids), _addr(hashes), num, parent_hash is not None,
            parent_hash or 0, lora, _addr(dups), _addr(self._num_dups),
        )  # fmt: skip
        self._check_range(bad, block_ids)
        done = num if bad < 0 else bad
        if self._tokens is not None:
            self._copy_tokens(ids, dups, done, token_ids)
        assert bad < 0, "caching a bad block"
        run_start, run_parent = 0, parent_hash  # the current run: block_hashes[run_start:i]
        if self._num_dups[0]:  # hashes computed twice concurrently: those blocks stay uncached
            for i in (i for i in range(num) if dups[i]):
                self._flush_run(block_hashes, run_start, i, run_parent, token_ids, lora_name)
                run_start, run_parent = i + 1, block_hashes[i]
        self._flush_run(block_hashes, run_start, num, run_parent, token_ids, lora_name)

    def _copy_tokens(
        self, ids: array[int], dups: array[int], num: int, token_ids: Sequence[int]
    ) -> None:
        tokens, size = self._tokens, self.block_size
        assert tokens is not None
        for i in range(num):
            if not dups[i]:
                start = ids[i] * size
                tokens[start : start + size] = array("q", token_ids[i * size : (i + 1) * size])

    def _lora(self, name: str) -> int:
        index = self._lora_index.get(name)
        if index is None:
            index = self._lora_index[name] = len(self._lora_names)
            self._lora_names.append(name)
        return index

    def release(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        bad = self._lib.th_pool_release(self._p, _addr(ids := array("q", block_ids)), len(ids))
        self._check_range(bad, block_ids)
        assert bad < 0, f"double free of block {block_ids[bad]}"

    def _check_range(self, code: int, block_ids: Sequence[int]) -> None:
        if code == -2:  # the C call changed nothing
            bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
            raise IndexError(f"block ids {bad[:8]} out of range 0..{self.num_blocks - 1}")

    def _block_id(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range 0..{self.num_blocks - 1}")
        return block_id

    # ------------------------------------------------------------------ snapshot / checks
    def snapshot(self) -> list[KvEvent]:
        num = self.num_cached_blocks
        ids, hashes, parents, stamps = (array(t, bytes(8 * num)) for t in "qQQQ")
        flags, loras = array("B", bytes(num)), array("i", bytes(4 * num))
        self._lib.th_pool_cached(
            self._p, _addr(ids), _addr(hashes), _addr(parents), _addr(flags), _addr(loras),
            _addr(stamps),
        )  # fmt: skip
        order = sorted(range(num), key=stamps.__getitem__)  # the order blocks were cached in
        names = self._lora_names
        return self._snapshot_of(
            {hashes[k]: ids[k] for k in order},
            {ids[k]: parents[k] if flags[k] else None for k in order},
            {ids[k]: names[loras[k]] if loras[k] >= 0 else None for k in order},
        )

    def check_integrity(self) -> None:
        where = array("q", [0])
        code = self._lib.th_pool_check(self._p, _addr(where))
        if code == -2:
            raise MemoryError("no memory to check the C block pool")
        if code:
            raise AssertionError(_CHECKS[code].format(where[0]))


def _u64s(values: Sequence[int]) -> array[int]:
    return values if isinstance(values, array) and values.typecode == "Q" else array("Q", values)
