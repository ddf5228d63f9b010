from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.indexer import KvIndexer, WorkerKey

pytestmark = pytest.mark.timeout(60)

W0, W1 = WorkerKey("w0"), WorkerKey("w1")


def test_prefix_depth_per_worker() -> None:
    idx = KvIndexer()
    idx.store(W0, [1, 2, 3])
    idx.store(W1, [1, 2])
    idx.store(WorkerKey("w2"), [2, 3])  # no first block: not a match
    idx.check_integrity()
    assert idx.find_matches([1, 2, 3, 4]) == {W0: 3, W1: 2}
    assert idx.find_matches([9, 1]) == {}
    idx.remove(W0, [2])
    assert idx.find_matches([1, 2, 3]) == {W0: 1, W1: 2}
    idx.check_integrity()


def test_engine_hashes_alias_removals_and_clear() -> None:
    idx = KvIndexer()
    idx.store(W0, [11, 12], engine_hashes=[101, 102])
    assert idx.resolve(W0, 102) == 12
    assert idx.remove(W0, [102]) == 1
    assert idx.find_matches([11, 12]) == {W0: 1}
    idx.store(W0, [11], medium="host")
    assert idx.has_tiers()
    assert idx.clear(W0, "device") == 1
    assert idx.find_matches([11]) == {}
    assert idx.find_matches([11], media=("device", "host")) == {W0: 1}
    idx.check_integrity()


def test_remove_worker_frees_slot_for_reuse() -> None:
    idx = KvIndexer()
    idx.store(W0, [1])
    idx.store(WorkerKey("w0", 1), [1, 2])
    idx.store(W1, [1])
    assert idx.remove_worker("w0") == 3
    idx.check_integrity()
    assert idx.find_matches([1, 2]) == {W1: 1}
    idx.store(WorkerKey("w3"), [1, 2])
    idx.check_integrity()
    assert idx.find_matches([1, 2]) == {W1: 1, WorkerKey("w3"): 2}


workers = st.sampled_from([WorkerKey(f"w{i}", i % 2) for i in range(5)])
hashes = st.lists(st.integers(0, 12), max_size=6)
media = st.sampled_from(["device", "host"])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), workers, hashes, media),
        st.tuples(st.just("remove"), workers, hashes, media),
        st.tuples(st.just("clear"), workers, st.just([]), st.sampled_from([None, "device"])),
        st.tuples(st.just("leave"), workers, st.just([]), st.just(None)),
    ),
    max_size=40,
)


def brute_matches(ref: dict, query: list[int], tiers: tuple[str, ...]) -> dict:
    out = {}
    for key, per_medium in ref.items():
        held = set().union(*(per_medium.get(m, set()) for m in tiers))
        depth = 0
        for h in query:
            if h not in held:
                break
            depth += 1
        if depth:
            out[key] = depth
    return out


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), max_size=5))
def test_matches_brute_force_reference(op_list: list, queries: list[list[int]]) -> None:
    idx = KvIndexer()
    ref: dict[WorkerKey, dict[str, set[int]]] = {}
    for op, key, hs, medium in op_list:
        if op == "store":
            idx.store(key, hs, medium)
            ref.setdefault(key, {}).setdefault(medium, set()).update(hs)
        elif op == "remove":
            idx.remove(key, hs, medium)
            ref.get(key, {}).get(medium, set()).difference_update(hs)
        elif op == "clear":
            idx.clear(key, medium)
            for m, s in ref.get(key, {}).items():
                if medium is None or m == medium:
                    s.clear()
        else:
            idx.remove_worker(key.worker_id)
            for k in [k for k in ref if k.worker_id == key.worker_id]:
                del ref[k]
        idx.check_integrity()
    for q in queries:
        assert idx.find_matches(q) == brute_matches(ref, q, ("device",))
        assert idx.find_matches(q, ("device", "host")) == brute_matches(ref, q, ("device", "host"))
    expected = {k: {m: frozenset(s) for m, s in v.items() if s} for k, v in ref.items()}
    assert idx.snapshot() == {k: v for k, v in expected.items() if v}


def test_holes_and_recurring_masks_keep_exact_depths() -> None:
    """Blocks held out of prefix order (a parent evicted before its child) must not fool the
    bisected lookup bound or the run-length walk."""
    idx = KvIndexer()
    chain = list(range(100, 130))
    idx.store(W0, chain[:20])
    idx.remove(W0, [chain[5]])  # hole: W0 holds 0-4 and 6-19
    idx.store(W1, chain[:12] + chain[15:18])  # W1's mask recurs after a gap
    idx.check_integrity()
    assert idx.find_matches(chain) == {W0: 5, W1: 12}
    assert idx.find_matches(chain[:11]) == {W0: 5, W1: 11}
    idx.store(W0, [chain[5]])
    assert idx.find_matches(chain) == {W0: 20, W1: 12}
    assert idx.find_matches(chain[6:]) == {W0: 14, W1: 6}


def test_interned_masks_stay_bounded_under_churn() -> None:
    """Every holder set ever seen gets an interned mask; dead ones must be swept."""
    rng = random.Random(0)
    idx = KvIndexer()
    keys = [WorkerKey(f"w{i}") for i in range(40)]
    masks_seen: set[str] = set()  # as text: holding the ints would keep them alive
    largest = 0
    for turn in range(600):  # each turn a random holder set for the same blocks
        holders = rng.sample(keys, 20)
        for k in holders:
            idx.store(k, range(turn % 50, turn % 50 + 30))
            masks_seen.update(map(hex, idx._holders["device"].values()))
            largest = max(largest, len(idx._intern))
            idx.check_integrity()  # live masks stay interned across sweeps
        for k in holders[:-1]:
            idx.remove(k, range(turn % 50, turn % 50 + 30))
        idx.clear(holders[-1])
    idx.check_integrity()
    assert idx.snapshot() == {}
    assert len(masks_seen) > 2 * 4096
    assert largest <= 4096 + len(keys)


chain_ids = st.integers(0, 24)
long_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), workers, st.lists(chain_ids, max_size=25), media),
        st.tuples(
            st.just("store"), workers, st.integers(0, 25).map(lambda n: list(range(n))), media
        ),
        st.tuples(st.just("remove"), workers, st.lists(chain_ids, max_size=8), media),
    ),
    max_size=25,
)
long_queries = st.lists(
    st.one_of(st.lists(chain_ids, max_size=30), st.integers(1, 30).map(lambda n: list(range(n)))),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(long_ops, long_queries)
def test_long_chains_match_brute_force_reference(op_list: list, queries: list[list[int]]) -> None:
    """Chains longer than the lookup-bound threshold, with holes and recurring masks."""
    idx = KvIndexer()
    ref: dict[WorkerKey, dict[str, set[int]]] = {}
    for op, key, hs, medium in op_list:
        if op == "store":
            idx.store(key, hs, medium)
            ref.setdefault(key, {}).setdefault(medium, set()).update(hs)
        else:
            idx.remove(key, hs, medium)
            ref.get(key, {}).get(medium, set()).difference_update(hs)
    idx.check_integrity()
    for q in queries:
        assert idx.find_matches(q) == brute_matches(ref, q, ("device",))
        assert idx.find_matches(q, ("device", "host")) == brute_matches(ref, q, ("device", "host"))
