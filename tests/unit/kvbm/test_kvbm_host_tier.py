"""HostTier: LRU eviction, capacity, data round trip, slot accounting (checked after each
mutation, and against a reference model with hypothesis)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tandem.kvbm.base import BlockMeta
from tandem.kvbm.host_tier import HostTier

META = BlockMeta(block_size=4, token_ids=(1, 2, 3, 4))


def _data(block_hash: int, size: int = 32) -> bytes:
    return bytes((block_hash * 7 + i) % 256 for i in range(size))


def test_round_trip_returns_a_copy_of_the_data() -> None:
    tier = HostTier(capacity_blocks=2, block_bytes=32)
    assert tier.put(1, _data(1, 20), META) == []
    tier.check_integrity()
    assert tier.get(1) == _data(1, 20)
    assert tier.meta(1) == META
    assert tier.get(2) is None


def test_lru_evicts_least_recently_used_and_reports_it() -> None:
    tier = HostTier(capacity_blocks=2, block_bytes=32)
    tier.put(1, _data(1), META)
    tier.put(2, _data(2), META)
    tier.get(1)  # 2 is now least recently used
    assert tier.put(3, _data(3), META) == [2]
    tier.check_integrity()
    assert (tier.contains(1), tier.contains(2), tier.contains(3)) == (True, False, True)
    assert tier.get(3) == _data(3) and tier.get(1) == _data(1)  # slot reuse kept data apart
    assert tier.num_blocks == 2


def test_contains_does_not_touch_lru() -> None:
    tier = HostTier(capacity_blocks=2, block_bytes=8)
    tier.put(1, _data(1, 8), META)
    tier.put(2, _data(2, 8), META)
    assert tier.contains(1)
    assert tier.put(3, _data(3, 8), META) == [1]


def test_put_of_present_hash_refreshes_only() -> None:
    tier = HostTier(capacity_blocks=2, block_bytes=8)
    tier.put(1, _data(1, 8), META)
    tier.put(2, _data(2, 8), META)
    assert tier.put(1, _data(1, 8), META) == []
    assert tier.put(3, _data(3, 8), META) == [2]
    tier.check_integrity()


def test_oversized_block_is_rejected() -> None:
    tier = HostTier(capacity_blocks=1, block_bytes=8)
    with pytest.raises(ValueError, match="exceeds block_bytes=8"):
        tier.put(1, bytes(9), META)
    tier.check_integrity()
    assert tier.num_blocks == 0


def test_accepts_numpy_arrays() -> None:
    tier = HostTier(capacity_blocks=1, block_bytes=16)
    arr = np.arange(4, dtype=np.float32)
    tier.put(1, arr, META)  # type: ignore[arg-type]
    assert np.frombuffer(tier.get(1) or b"", dtype=np.float32).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_remove_lookup_and_clear() -> None:
    tier = HostTier(capacity_blocks=4, block_bytes=8)
    for h in (10, 11, 12):
        tier.put(h, _data(h, 8), META)
    assert tier.lookup([10, 11, 12, 13]) == 3
    assert tier.remove(11) and not tier.remove(11)
    tier.check_integrity()
    assert tier.lookup([10, 11, 12]) == 1
    assert sorted(tier.clear()) == [10, 12]
    tier.check_integrity()
    assert tier.num_blocks == 0 and tier.block_hashes() == []


class HostTierMachine(RuleBasedStateMachine):
    """Random put/get/remove against an OrderedDict model of LRU with capacity 3."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(capacity_blocks=3, block_bytes=16)
        self.model: OrderedDict[int, bytes] = OrderedDict()

    @rule(block_hash=st.integers(0, 6), size=st.integers(1, 16))
    def put(self, block_hash: int, size: int) -> None:
        data = _data(block_hash, size)
        evicted = self.tier.put(block_hash, data, META)
        if block_hash in self.model:
            self.model.move_to_end(block_hash)
            assert evicted == []
            return
        expected = []
        while len(self.model) >= 3:
            expected.append(self.model.popitem(last=False)[0])
        self.model[block_hash] = data
        assert evicted == expected

    @rule(block_hash=st.integers(0, 6))
    def get(self, block_hash: int) -> None:
        assert self.tier.get(block_hash) == self.model.get(block_hash)
        if block_hash in self.model:
            self.model.move_to_end(block_hash)

    @rule(block_hash=st.integers(0, 6))
    def remove(self, block_hash: int) -> None:
        assert self.tier.remove(block_hash) == (self.model.pop(block_hash, None) is not None)

    @invariant()
    def consistent(self) -> None:
        self.tier.check_integrity()
        assert self.tier.block_hashes() == list(self.model)


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
