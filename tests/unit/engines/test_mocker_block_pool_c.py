"""The C block pool against the Python one (its reference): long random operation sequences
on both, every result, event, counter and integrity check compared after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tandem.cbuild import compiler
from tandem.engines.mocker import c_block_pool
from tandem.engines.mocker.block_pool import BlockPool, PyBlockPool
from tandem.engines.mocker.c_block_pool import CBlockPool, new_block_pool
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.kvbm.base import KvbmConfig
from tandem.protocols.engine import PreprocessedRequest, StopConditions

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler")
# the library as built, without the load-time sample check: a disagreement fails here, named
LIB = c_block_pool._load(check=False) if compiler() is not None else None


@dataclass
class _Seq:
    block_ids: list[int] = field(default_factory=list)
    num_committed: int = 0  # blocks cached (or found a duplicate) so far
    last_hash: int | None = None
    hashes: list[int] = field(default_factory=list)  # of the committed blocks


def _state(pool: BlockPool) -> tuple[object, ...]:
    pool.check_integrity()
    return (
        pool.num_active_blocks,
        pool.num_allocatable_blocks,
        pool.num_cached_blocks,
        pool.usage,
        [pool.ref_count(b) for b in range(pool.num_blocks)],
    )


class _Pair:
    """Runs each operation on both pools and asserts they answer and end up the same."""

    def __init__(self, num_blocks: int, block_size: int, keep: bool, record: bool) -> None:
        self.c = CBlockPool(num_blocks, block_size, keep_token_ids=keep, lib=LIB)
        self.py = PyBlockPool(num_blocks, block_size, keep_token_ids=keep)
        self.c.record_evictions = self.py.record_evictions = record

    def do(self, op: str, *args: object) -> object:
        got, want = getattr(self.c, op)(*args), getattr(self.py, op)(*args)
        assert got == want, f"{op}{args}: C {got} != Python {want}"
        assert self.c.drain_events() == self.py.drain_events(), f"events after {op}{args}"
        assert _state(self.c) == _state(self.py), f"state after {op}{args}"
        return want


def _run(seed: int, num_blocks: int, block_size: int, keep: bool, record: bool) -> None:
    rng = random.Random(seed)
    pair = _Pair(num_blocks, block_size, keep, record)
    # a small hash universe makes duplicates and prefix hits common; big random u64s stress
    # the C hash table's probing and deletion
    universe = [rng.getrandbits(64) for _ in range(num_blocks)] + list(range(num_blocks))
    seqs: list[_Seq] = []
    for _ in range(1500):
        roll = rng.random()
        if roll < 0.25 or not seqs:  # grow (or start) a sequence, evicting when full
            seq = rng.choice(seqs) if seqs and rng.random() < 0.6 else _Seq()
            fresh = pair.do("allocate", rng.randint(0, max(2, num_blocks // 3)))
            if isinstance(fresh, list):
                seq.block_ids += fresh
                if seq not in seqs:
                    seqs.append(seq)
        elif roll < 0.5:  # cache the next computed blocks of a sequence
            seq = rng.choice(seqs)
            num = rng.randint(0, len(seq.block_ids) - seq.num_committed)
            hashes = [rng.choice(universe) for _ in range(num)]
            tokens = [rng.randrange(1 << 31) for _ in range(num * block_size)]
            lora = rng.choice([None, None, "a", "b"])
            start = seq.num_committed
            pair.do("cache_full_blocks", seq.block_ids[start : start + num], hashes,
                    seq.last_hash, tokens, lora)  # fmt: skip
            seq.num_committed += num
            seq.last_hash = hashes[-1] if hashes else seq.last_hash
            seq.hashes += hashes
        elif roll < 0.65:  # a new sequence from a cached prefix
            probe = [rng.choice(universe) for _ in range(rng.randint(0, 4))]
            if seqs and rng.random() < 0.5:  # a long prefix that is (mostly) cached
                known = rng.choice(seqs).hashes
                probe = known[: rng.randint(0, len(known))] + probe
            hits = pair.do("match_prefix", probe)
            assert isinstance(hits, list)
            pair.do("acquire", hits)
            if hits:
                seqs.append(_Seq(list(hits), len(hits), probe[len(hits) - 1]))
        elif roll < 0.72 and seqs:  # another holder of a sequence's blocks (a pin)
            seq = rng.choice(seqs)
            pair.do("acquire", seq.block_ids)
            seqs.append(_Seq(list(seq.block_ids), len(seq.block_ids), seq.last_hash))
        elif roll < 0.92:
            seq = seqs.pop(rng.randrange(len(seqs)))
            pair.do("release", seq.block_ids)
        elif roll < 0.96:
            pair.do("take_evicted")
        else:
            pair.do("snapshot")
    for seq in seqs:
        pair.do("release", seq.block_ids)
    pair.do("snapshot")
    pair.do("take_evicted")
    assert pair.c.num_active_blocks == 0


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(1, 1), (7, 1), (16, 4), (64, 2), (257, 16)]
)
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("record", [True, False])
def test_c_pool_equals_python_pool_on_random_operations(
    num_blocks: int, block_size: int, keep: bool, record: bool
) -> None:
    for seed in range(3):
        _run(seed * 1000 + num_blocks, num_blocks, block_size, keep, record)


def test_duplicate_hashes_split_stored_events_the_same_way() -> None:
    pair = _Pair(8, 2, keep=True, record=False)
    first = pair.do("allocate", 2)
    pair.do("cache_full_blocks", first, [5, 6], None, [1, 2, 3, 4], "a")
    ids = pair.do("allocate", 5)
    # 5 is cached already, 9 repeats within the call: those blocks stay uncached
    pair.do("cache_full_blocks", ids, [7, 5, 8, 9, 9], 3, list(range(10)), "a")
    pair.do("snapshot")
    pair.do("release", ids)
    pair.do("release", first)


def test_misuse_raises_the_same_assertion() -> None:
    for pool in (CBlockPool(4, 2, lib=LIB), PyBlockPool(4, 2)):
        ids = pool.allocate(2)
        assert ids is not None
        with pytest.raises(AssertionError, match="acquiring a free block"):
            pool.acquire([3])
        pool.cache_full_blocks(ids[:1], [1], None, [0, 0])
        with pytest.raises(AssertionError, match="caching a bad block"):
            pool.cache_full_blocks(ids[:1], [2], None, [0, 0])
        pool.release(ids)
        with pytest.raises(AssertionError, match=f"double free of block {ids[0]}"):
            pool.release(ids[:1])


def test_new_block_pool_is_the_c_pool_else_the_python_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(new_block_pool(4, 2)) is CBlockPool
    monkeypatch.setattr(c_block_pool, "c_core", lambda: None)
    assert type(new_block_pool(4, 2)) is PyBlockPool


def test_check_integrity_sees_a_corrupted_c_pool() -> None:
    pool = CBlockPool(4, 2, lib=LIB)
    ids = pool.allocate(2)
    assert ids is not None
    pool.check_integrity()
    pool._counts[3] += 1  # the active counter drifts
    with pytest.raises(AssertionError, match="num_active"):
        pool.check_integrity()


@pytest.mark.parametrize("kvbm", [None, KvbmConfig(host_blocks=12)])
@pytest.mark.parametrize("token_ids", [True, False])
def test_scheduler_steps_the_same_on_either_pool(kvbm: KvbmConfig | None, token_ids: bool) -> None:
    """Chunked prefills, prefix hits, preemption and eviction driven by the scheduler: the
    same outputs, KV events and timing with the C pool as with the Python one."""
    config = MockerConfig(
        num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
        context_length=96, tokenizer=None, speedup_ratio=0, kv_bytes_per_token=1 << 16,
        kvbm=kvbm, kv_events_token_ids=token_ids,
    )  # fmt: skip
    scheds = [Scheduler(config), Scheduler(config)]
    scheds[0].pool = CBlockPool(24, 4, keep_token_ids=token_ids, lib=LIB)
    scheds[1].pool = PyBlockPool(24, 4, keep_token_ids=token_ids)
    for s in scheds:
        s.pool.record_evictions = kvbm is not None
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    for i in range(300):
        if rng.random() < 0.3:
            prompt = [
                *rng.choice(prefixes),
                *(rng.randrange(50) for _ in range(rng.randint(0, 30))),
            ]
            request = PreprocessedRequest(
                request_id=f"r{i}", model="m", token_ids=prompt,
                stop=StopConditions(max_tokens=rng.randint(1, 8)),
            )  # fmt: skip
            for s in scheds:
                s.add_request(request)
        results = [s.step() for s in scheds]
        c, py = ([(seq.request_id, out) for seq, out in r.outputs] for r in results)
        assert c == py and results[0].events == results[1].events
        assert results[0].duration_ms == results[1].duration_ms
        for s in scheds:
            s.check_integrity()


def test_c_pool_refuses_out_of_range_block_ids_and_changes_nothing() -> None:
    pool = CBlockPool(4, 2, lib=LIB)
    ids = pool.allocate(2)
    assert ids is not None
    for op, args in (("release", ([*ids, 4],)), ("acquire", ([-1],)),
                     ("cache_full_blocks", ([ids[0], 9], [1, 2], None, [0] * 4))):  # fmt: skip
        with pytest.raises(IndexError, match=r"out of range 0\.\.3"):
            getattr(pool, op)(*args)
        assert pool.num_active_blocks == 2 and pool.num_cached_blocks == 0
        pool.check_integrity()
