from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.router.cost import (
    CandidateCost,
    candidate_cost,
    choose,
    softmax_weights,
    tiered_overlap,
)

pytestmark = pytest.mark.timeout(10)


def cc(wid: str, cost: float, cached: int = 0) -> CandidateCost:
    return CandidateCost(
        worker_id=wid,
        overlap_blocks=0,
        prefill_blocks=0,
        decode_blocks=0,
        cost=cost,
        cached_blocks=cached,
    )


def test_cost_formula_matches_design() -> None:
    # ISL 100 tokens, B 16, overlap 4 blocks -> uncached 36 tokens; 32 active prefill tokens
    c = candidate_cost(
        worker_id="w",
        num_tokens=100,
        block_size=16,
        overlap_blocks=4,
        active_prefill_tokens=32,
        active_blocks=10,
        num_new_blocks=3,
        overlap_weight=2.0,
    )
    assert c.prefill_blocks == pytest.approx((32 + 36) / 16)
    assert c.decode_blocks == 13
    assert c.cost == pytest.approx(2.0 * (68 / 16) + 13)
    full = candidate_cost(
        worker_id="w",
        num_tokens=32,
        block_size=16,
        overlap_blocks=3,
        active_prefill_tokens=0,
        active_blocks=0,
        num_new_blocks=0,
        overlap_weight=1.0,
    )
    assert full.prefill_blocks == 0  # overlap beyond the prompt never goes negative


def test_tier_partial_credit() -> None:
    assert tiered_overlap(2, 4, 6, host_credit=0.5, disk_credit=0.25) == 2 + 1 + 0.5


def test_temperature_zero_ties_by_smaller_cache_then_random() -> None:
    rng = random.Random(0)
    assert choose([cc("a", 3), cc("b", 1), cc("c", 2)], 0, rng).worker_id == "b"
    assert choose([cc("a", 1, cached=9), cc("b", 1, cached=2)], 0, rng).worker_id == "b"
    picks = Counter(choose([cc("a", 1), cc("b", 1)], 0, rng).worker_id for _ in range(200))
    assert picks["a"] > 50 and picks["b"] > 50


def test_softmax_over_min_max_normalised_costs() -> None:
    w = softmax_weights([10, 20, 30], temperature=1.0)
    assert w[0] > w[1] > w[2]
    # normalisation: scaling all costs changes nothing
    assert softmax_weights([100, 200, 300], 1.0) == pytest.approx(w)
    assert softmax_weights([5, 5], 0.5) == pytest.approx([0.5, 0.5])
    rng = random.Random(1)
    picks = Counter(choose([cc("a", 0), cc("b", 1)], 0.5, rng).worker_id for _ in range(2000))
    # p(a) = 1 / (1 + e^-2) ≈ 0.88
    assert 0.84 < picks["a"] / 2000 < 0.92
